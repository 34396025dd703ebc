"""Colours and marks shared by the screens: one place decides what "fragile" looks like."""
from __future__ import annotations

import math

from rich.text import Text

# top-1 minus top-2 logit: below each bound, that background (the nearer the tie, the hotter)
MARGIN_SHADES = ((1e-4, "white on red3"), (1e-3, "black on dark_orange3"), (1e-2, "black on gold3"),
                 (1e-1, "black on khaki3"), (1.0, "on grey30"))
BOUND_TEXT = {1e-4: "1e-4", 1e-3: "1e-3", 1e-2: "0.01", 1e-1: "0.1", 1.0: "1"}
FIRST_DIVERGENT = "▶"
FIRST_NUMERIC = "Δ"
TOKEN_DIFFERS = "≠"
LOGITS_DIFFER = "≈"
ROOT_CAUSE = "◆"
DIVERGENT_STEP = "▶"
IN_STEP = "●"

DIVERGED_ROW = "bold"
ROOT_CAUSE_ROW = "bold white on dark_red"
DIVERGENT_STEP_ROW = "bold black on gold3"
SIDE_DIFFERS = "bold red"
SAME = ""


def cells(*cols: tuple, sep: str = " ") -> Text:
    """One line of fixed-width cells: (content, width[, justify]). Cheaper than a rich Table."""
    line = Text(no_wrap=True, end="")
    for i, col in enumerate(cols):
        content, width = col[0], col[1]
        justify = col[2] if len(col) > 2 else "left"
        t = content.copy() if isinstance(content, Text) else Text(str(content))
        if t.cell_len > width:
            t.truncate(width, overflow="ellipsis")
        t.align(justify, width)
        if i:
            line.append(sep)
        line.append_text(t)
    return line


def margin_style(margin: float) -> str:
    if margin is None or math.isnan(margin):
        return ""
    for bound, style in MARGIN_SHADES:
        if margin < bound:
            return style
    return ""


def fmt_margin(margin: float) -> str:
    if margin is None or math.isnan(margin):
        return ""
    return f"{margin:.3g}" if margin < 0.01 else f"{margin:.3f}"


def margin_legend() -> Text:
    t = Text("margin ")
    for bound, style in MARGIN_SHADES:
        t.append(f"<{BOUND_TEXT.get(bound, f'{bound:g}')}", style)
        t.append(" ")
    return t


def marks_legend(two: bool) -> Text:
    t = Text()
    if two:
        t.append(f"{FIRST_DIVERGENT} first divergent  ", "bold red")
        t.append(f"{FIRST_NUMERIC} first numeric  ", "bold yellow")
        t.append(f"{LOGITS_DIFFER} logits differ  ", "yellow")
        t.append(f"{TOKEN_DIFFERS} token differs", "red")
    return t
