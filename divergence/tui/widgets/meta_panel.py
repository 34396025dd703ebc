"""Run metadata (or totals) of one or two traces, side by side; values that differ stand out."""
from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.widgets import Static


class MetaPanel(Static):
    DEFAULT_CSS = """
    MetaPanel { height: auto; padding: 0 1; }
    """

    def __init__(self, title: str, *, id: str | None = None):
        super().__init__("", id=id)
        self.title = title

    def show(self, rows: list[tuple[str, list[str]]], labels: list[str]) -> None:
        t = Table(title=self.title, title_justify="left", title_style="bold", box=None, padding=(0, 1),
                  show_edge=False, expand=True)
        t.add_column("", style="dim", no_wrap=True)
        for lab in labels:
            t.add_column(lab, no_wrap=True, overflow="ellipsis", ratio=1)
        for name, vals in rows:
            differ = len(set(vals)) > 1
            t.add_row(name, *[Text(v, style="yellow" if differ else "") for v in vals])
        self.update(t)
