"""Both sides' top-k candidates of one token: ids, text, exact logits, Δ against the other side."""
from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from ..data import TopK, TopKSide, fmt_delta, fmt_logit


class TopKPanel(Static):
    DEFAULT_CSS = """
    TopKPanel { height: auto; max-height: 50%; border-top: solid $primary; padding: 0 1; }
    """

    def __init__(self, *, id: str | None = None):
        super().__init__("", id=id)
        self.topk: TopK | None = None

    def show(self, topk: TopK | None) -> None:
        self.topk = topk
        self.update(self._render_topk(topk) if topk else "")

    def _side_table(self, side: TopKSide | None, label: str) -> Table:
        if side is None:
            t = Table(title=f"{label}: no token at this position", title_justify="left", box=None,
                      title_style="bold")
            return t
        chosen = f"{side.token} {side.texts[side.ids.index(side.token)] if side.token in side.ids else ''}"
        t = Table(title=f"{side.label} · step {side.step} · chose {chosen}", title_justify="left",
                  title_style="bold", box=None, padding=(0, 1), show_edge=False, expand=False)
        t.add_column("#", justify="right", style="dim")
        t.add_column("id", justify="right")
        t.add_column("text", max_width=14, no_wrap=True)
        t.add_column("logit (float32)", justify="right")
        t.add_column("Δ vs other", justify="right")
        for rank, (i, text, logit, delta) in enumerate(zip(side.ids, side.texts, side.logits, side.deltas)):
            style = "bold" if i == side.token else ""
            d = Text(fmt_delta(delta), style="yellow" if delta else "dim")
            if delta is None and self.topk and sum(s is not None for s in self.topk.sides) == 2:
                d = Text("not in other", style="dim italic")
            mark = " ◀" if i == side.token else ""
            t.add_row(str(rank + 1), str(i), Text(text + mark, style=style), Text(fmt_logit(logit), style=style), d)
        return t

    def _render_topk(self, topk: TopK):
        head = Text(f"{topk.request_id} · position {topk.position} (generated #{topk.generated_index}) · top-k",
                    style="bold")
        if len(topk.sides) == 1:
            return Group(head, self._side_table(topk.sides[0], "A"))
        grid = Table.grid(padding=(0, 3))
        grid.add_column()
        grid.add_column()
        grid.add_row(self._side_table(topk.sides[0], "A"), self._side_table(topk.sides[1], "B"))
        return Group(head, grid)
