"""How the browser writes tokens, logits and position spans as text."""
from __future__ import annotations

import numpy as np

from ...core.labels import span_text as _span_text

_CONTROL = {"\n": "⏎", "\t": "⇥", "\r": "␍"}


def show_piece(piece: str | None) -> str:
    """A token's text made visible on one line: newlines, tabs and a leading space shown."""
    if piece is None:
        return ""
    out = []
    for ch in piece:
        if ch in _CONTROL:
            out.append(_CONTROL[ch])
        elif ord(ch) < 32 or ord(ch) == 127:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    s = "".join(out)
    return "␣" + s[1:] if s.startswith(" ") else s


def fmt_logit(x) -> str:
    """A float32 logit to full precision: the shortest text that reads back to the same bits."""
    x = np.float32(x)
    return "nan" if np.isnan(x) else str(x)


def fmt_delta(x) -> str:
    return "" if x is None or np.isnan(x) else ("0" if x == 0 else f"{x:+.3e}")


def span_text(positions) -> str:
    return _span_text(positions, most=6)
