"""Overview: run metadata side by side, totals, and every request with its status and root cause."""
from __future__ import annotations

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import Footer, Header, Static

from ..data import RequestRow
from ..messages import OpenRequest, RowHighlighted, RowSelected
from ..widgets.meta_panel import MetaPanel
from ..widgets.virtual_table import Column, VirtualTable
from .base import BrowseScreen


class OverviewScreen(BrowseScreen):
    HELP = "every request: identical or where it diverged, and the batch step that caused it"
    GOTO_PROMPT = "request id"
    SEARCH_PROMPT = "request id (substring)"
    PAIR_ACTIONS = ("next_diverged",)
    BINDINGS = [
        Binding("enter", "open", "tokens", show=False),
        Binding("d", "next_diverged", "next diverged"),
    ]

    def __init__(self):
        super().__init__()
        self.rows: list[RequestRow] = []
        self._search = ""

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="overview-meta"):
            yield MetaPanel("run", id="meta")
            yield MetaPanel("totals", id="totals")
        yield VirtualTable(id="requests")
        yield Static(id="request-detail")
        yield Footer()

    def on_mount(self) -> None:
        d = self.data
        labels = [d.label(s) for s in d.sides]
        self.query_one("#meta", MetaPanel).show(d.meta_rows(), labels)
        self.refresh_data()
        self.query_one("#requests", VirtualTable).focus()

    def _columns(self) -> list[Column]:
        if self.data.two:
            return [Column("request", 10), Column("prompt", 6, "right"), Column("A tok", 6, "right"),
                    Column("B tok", 6, "right"), Column("status", 24), Column("numeric Δ", 9, "right"),
                    Column("root cause", 34), Column("co-batched (B)", 0)]
        return [Column("request", 10), Column("prompt", 6, "right"), Column("tokens", 6, "right"),
                Column("finished", 8, "right"), Column("text", 0)]

    def refresh_data(self) -> None:
        d = self.data
        self.query_one("#totals", MetaPanel).show(d.totals(), ["AB"[s] for s in d.sides])
        table = self.query_one("#requests", VirtualTable)
        self.rows = self.data.request_rows()
        current = self.browser.current_request
        cursor = next((i for i, r in enumerate(self.rows) if r.id == current), 0)
        table.set_rows(len(self.rows), self._render_row, self._columns(), cursor=cursor)
        self._show_detail(table.cursor)

    def _render_row(self, i: int):
        r = self.rows[i]
        n_a = "…" if r.len_a is None else str(r.len_a)
        if not self.data.two:
            if r.len_a is None:  # not read yet
                return [r.id, str(r.prompt_len), n_a, "", ""], None
            fin = self.data.trace(0).finish_step(r.id)
            text = self.data.decoded(r.id, 0, 0, 80).replace("\n", "⏎")
            return [r.id, str(r.prompt_len), n_a, "" if fin is None else str(fin), text], None
        text = r.status_text()
        status = Text(text, style="bold red" if r.diverged else "dim" if r.status == "..." else
                      "yellow" if "logits differ" in text else "green")
        co = ", ".join(r.cause.co_batched_b) if r.cause else ""
        n_b = "…" if r.len_b is None else str(r.len_b)
        return ([r.id, str(r.prompt_len), n_a, n_b, status, r.numeric_text(),
                 Text(r.cause_text(), style="red" if r.cause else ""), co], "bold" if r.diverged else None)

    @on(RowHighlighted, "#requests")
    def _highlighted(self, event: RowHighlighted) -> None:
        if self.rows:
            self.browser.current_request = self.rows[event.row].id
        self._show_detail(event.row)

    @on(RowSelected, "#requests")
    def _selected(self, event: RowSelected) -> None:
        self.post_message(OpenRequest(self.rows[event.row].id))

    def action_open(self) -> None:
        self.query_one("#requests", VirtualTable).action_select()

    def _show_detail(self, row: int) -> None:
        detail = self.query_one("#request-detail", Static)
        if not self.rows:
            detail.update("")
            return
        r = self.rows[row]
        d = self.data
        if d.two and not d.analysed:
            detail.update(Text("analysing (diff + bisect)…", style="dim italic"))
            return
        if d.analysis_error:
            detail.update(Text(f"analysis failed: {d.analysis_error}", style="red"))
            return
        lines = d.report_lines(r.id) if d.two else [f"{r.id}  prompt: {d.prompt_text(r.id)!r}"]
        text = Text("\n".join(lines))
        text.append("\nenter: tokens · s: steps · k: KV cache", style="dim")
        detail.update(text, layout=False)

    def action_next_diverged(self) -> None:
        table = self.query_one("#requests", VirtualTable)
        n = len(self.rows)
        for k in range(1, n + 1):
            i = (table.cursor + k) % n
            if self.rows[i].diverged:
                table.move_cursor(i)
                return
        self.notify("no diverged request", severity="warning")

    def goto(self, text: str) -> str | None:
        for i, r in enumerate(self.rows):
            if r.id == text.strip():
                self.query_one("#requests", VirtualTable).move_cursor(i)
                return None
        return f"no request {text.strip()!r}"

    def search(self, text: str, *, again: bool = False) -> str | None:
        self._search = text or self._search
        table = self.query_one("#requests", VirtualTable)
        n = len(self.rows)
        for k in range(1 if again else 0, n + 1):
            i = (table.cursor + k) % n
            if self._search in self.rows[i].id:
                table.move_cursor(i)
                return None
        return f"no request matches {self._search!r}"
