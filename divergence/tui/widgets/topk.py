"""Both sides' top-k candidates of one token: ids, text, exact logits, Δ against the other side."""
from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from ..data import TopK, TopKSide, fmt_delta, fmt_logit
from ..styles import cells

WIDTHS = (1, 2, 6, 10, 14, 11)  # mark, rank, id, text, logit, Δ: two sides fit in 100 columns
NARROW_WIDTHS = (1, 2, 6, 10, 12, 0)  # no Δ column: two sides fit in 76 columns
SIDE_WIDTH = sum(WIDTHS) + len(WIDTHS) - 1
GAP = "   "


def side_width(widths) -> int:
    return sum(widths) + sum(1 for w in widths if w) - 1


class TopKPanel(Static):
    DEFAULT_CSS = """
    TopKPanel { height: auto; border-top: solid $primary; padding: 0 1; }
    """

    def __init__(self, *, id: str | None = None):
        super().__init__("", id=id)
        self.topk: TopK | None = None
        self.max_rows: int | None = None  # candidates shown (None: all); the screen sets it by its height
        self.narrow = False  # leave out the Δ columns (two sides in 76 columns)

    def show(self, topk: TopK | None) -> None:
        height_before = self._lines(self.topk)
        self.topk = topk
        self.update(self._render_topk(topk) if topk else "", layout=self._lines(topk) != height_before)

    def _k(self, topk: TopK) -> int:
        k = max(len(s.ids) if s else 0 for s in topk.sides)
        return k if self.max_rows is None else max(1, min(k, self.max_rows))

    def _lines(self, topk: TopK | None) -> int:
        return 0 if topk is None else 3 + self._k(topk)

    def _side_lines(self, side: TopKSide | None, label: str, two: bool, k: int) -> list[Text]:
        if side is None:
            return [Text(f"{label}: no token at this position", style="bold")] + [Text()] * (k + 1)
        chosen = side.texts[side.ids.index(side.token)] if side.token in side.ids else ""
        title = Text(f"{side.label} · step {side.step} · chose {side.token} {chosen}", style="bold")
        w = NARROW_WIDTHS if self.narrow else WIDTHS

        def row(*cols):
            return cells(*(c for c in cols if c[1]))

        head = row(("", w[0]), ("#", w[1], "right"), ("id", w[2], "right"), ("text", w[3]),
                   ("logit (f32)", w[4], "right"), ("Δ vs other" if two else "", w[5], "right"))
        head.stylize("dim")
        out = [title, head]
        rows = list(zip(side.ids, side.texts, side.logits, side.deltas))
        if len(rows) > k:  # a short terminal: the top of the list, and the chosen token if it is lower
            mine = next((n for n, r in enumerate(rows) if r[0] == side.token), 0)
            keep = list(range(k)) if mine < k else list(range(k - 1)) + [mine]
        else:
            keep = list(range(len(rows)))
        for rank in keep:
            i, text, logit, delta = rows[rank]
            mine = i == side.token
            style = "bold" if mine else ""
            if delta is None:
                d = Text("absent" if two else "", style="dim italic")
            else:
                d = Text(fmt_delta(delta), style="yellow" if delta else "dim")
            out.append(row((Text("◀" if mine else "", style="bold"), w[0]), (str(rank + 1), w[1], "right"),
                           (Text(str(i), style=style), w[2], "right"), (Text(text, style=style), w[3]),
                           (Text(fmt_logit(logit), style=style), w[4], "right"), (d, w[5], "right")))
        out += [Text()] * (k + 2 - len(out))
        return out

    def _render_topk(self, topk: TopK) -> Text:
        two = len(topk.sides) == 2
        k = self._k(topk)
        width = side_width(NARROW_WIDTHS if self.narrow else WIDTHS)
        cols = [self._side_lines(s, "AB"[n], two, k) for n, s in enumerate(topk.sides)]
        text = Text(f"{topk.request_id} · position {topk.position} (generated #{topk.generated_index}) · top-k",
                    style="bold")
        for row in zip(*cols):
            text.append("\n")
            for n, part in enumerate(row):
                if n:
                    text.append(GAP)
                    part = part.copy()
                else:
                    part = part.copy()
                    if two:
                        part.truncate(width, overflow="ellipsis")
                        part.align("left", width)
                text.append_text(part)
        return text
