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
from ..widgets.virtual_table import Column, VirtualTable, fit
from .base import BrowseScreen

DETAIL_LINES = 9  # the detail panel's most lines (the report of one request)
MIN_DETAIL_LINES = 3
TABLE_ROWS = 14  # the table's lines the layout keeps before it gives the detail panel more


class OverviewScreen(BrowseScreen):
    HELP = "every request: identical or where it diverged, and the batch step that caused it"
    GOTO_PROMPT = "request id"
    SEARCH_PROMPT = "request id (substring)"
    PAIR_ACTIONS = ("next_diverged",)
    BINDINGS = [
        Binding("enter", "open", "tokens", show=False),
        Binding("d", "next_diverged", "next diverged"),
        Binding("m", "toggle_settings", "run settings"),
    ]

    def __init__(self):
        super().__init__()
        self.rows: list[RequestRow] = []
        self._search = ""
        self.settings_shown: bool | None = None  # None: decided by the terminal's height (m toggles it)

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="overview-summary")
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

    def on_resize(self) -> None:
        self._layout()

    def _meta_height(self) -> int:
        return max(len(self.data.meta_rows()), len(self.data.totals())) + 3  # title, header, border

    def _layout(self) -> None:
        """The request table first: the run settings take the screen only when it has room to spare
        (or when `m` asks for them); the detail panel gives up lines on a short terminal."""
        avail = (self.size.height or self.app.size.height) - 2  # header, footer
        table = min(len(self.rows) + 1, TABLE_ROWS)  # the table's header and rows, as many as fit
        shown = self.settings_shown
        if shown is None:
            shown = avail - self._meta_height() - table - 1 - DETAIL_LINES >= 0
        rest = avail - (self._meta_height() if shown else 1) - table - 1  # 1: the detail's border
        detail = max(MIN_DETAIL_LINES, min(DETAIL_LINES, rest))
        self.query_one("#request-detail", Static).styles.height = detail + 1
        self.query_one("#overview-meta").display = shown
        summary = self.query_one("#overview-summary", Static)
        summary.display = not shown
        if not shown:
            d = self.data
            t = Text("m", style="bold")
            t.append(" run settings · ", style="dim")
            t.append(" vs ".join(d.label(s) for s in d.sides), style="bold")
            pol = dict(d.meta_rows()).get("policy", [])
            if pol:
                t.append(f" · {' / '.join(dict.fromkeys(pol))}")
            tot = dict(d.totals())
            t.append(f" · {tot['requests'][0]} requests · {' / '.join(tot['steps'])} steps")
            summary.update(t)

    def action_toggle_settings(self) -> None:
        shown = self.query_one("#overview-meta").display
        self.settings_shown = not shown
        self._layout()

    def _columns(self) -> list[Column]:
        """Widths fit the rows; the status and the root cause come first (a narrow terminal scrolls
        the rest off the right, and the detail panel says them)."""
        rid = fit("request", (r.id for r in self.rows), most=24)
        if self.data.two:
            return [Column("request", rid), Column("A tok", 6, "right"), Column("B tok", 6, "right"),
                    Column("status", fit("status", (r.status_text() for r in self.rows), most=32)),
                    Column("root cause", fit("root cause", (r.cause_text() for r in self.rows), most=48)),
                    Column("numeric Δ", 9, "right"), Column("prompt", 6, "right"),
                    Column("co-batched (B)", 0, least=14)]
        return [Column("request", rid), Column("prompt", 6, "right"), Column("tokens", 6, "right"),
                Column("finished", 8, "right"), Column("text", 0)]

    def refresh_data(self) -> None:
        d = self.data
        self.query_one("#totals", MetaPanel).show(d.totals(), ["AB"[s] for s in d.sides])
        table = self.query_one("#requests", VirtualTable)
        self.rows = self.data.request_rows()
        current = self.browser.current_request
        cursor = next((i for i, r in enumerate(self.rows) if r.id == current), 0)
        table.set_rows(len(self.rows), self._render_row, self._columns(), cursor=cursor)
        self._layout()
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
        return ([r.id, n_a, n_b, status, Text(r.cause_text(), style="red" if r.cause else ""), r.numeric_text(),
                 str(r.prompt_len), co], "bold" if r.diverged else None)

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
        # one line each (cut at the edge, not wrapped): the root cause stays in view on a small terminal
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
