"""One request's generated tokens, A and B aligned by position, shaded by how fragile each was."""
from __future__ import annotations

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import Footer, Header, Static

from .. import styles as S
from ..data import A, B, TokenAlignment, fmt_delta
from ..messages import OpenStep, RowHighlighted, RowSelected
from ..widgets.routing import RoutingPanel
from ..widgets.topk import SIDE_WIDTH, GAP, TopKPanel
from ..widgets.virtual_table import Column, VirtualTable
from .base import RequestScreen

TABLE_LINES = 8  # the token table's lines (header + rows) the top-k panel leaves on a short terminal
NARROW = 2 * SIDE_WIDTH + len(GAP) + 4  # below this width: fewer columns, no Δ in the top-k
NARROW_KEEP = (0, 1, 4, 5, 6, 8, 9, 10, 11)  # mark, pos, A id/text/margin, B id/text/margin, max |Δlogit|


class TokenScreen(RequestScreen):
    HELP = "one request's tokens, A and B side by side; the top-k of both under the cursor"
    GOTO_PROMPT = "position, or #N for the N-th generated token"
    SEARCH_PROMPT = "token text"
    PAIR_ACTIONS = ("first_divergent", "first_numeric")
    BINDINGS = [
        Binding("d", "first_divergent", "first divergent"),
        Binding("f", "first_numeric", "first numeric Δ"),
        Binding("a", "step(0)", "A's step"),
        Binding("b", "step(1)", "B's step"),
        Binding("n", "search_again", "next match", show=False),
    ]

    def __init__(self, request_id: str, position: int | None = None):
        super().__init__(request_id, position)
        self.al: TokenAlignment | None = None
        self._search = ""

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="token-title")
        yield Static(id="token-prompt")
        yield Static(id="token-legend")
        yield Static(id="token-text")
        yield VirtualTable(id="tokens")
        yield TopKPanel(id="topk")
        yield RoutingPanel(id="routing")  # empty unless the model has expert layers
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#token-text", Static).styles.height = len(self.data.traces)
        self._fit()
        self.show_request(self.request_id, self.start_position)
        self.query_one("#tokens", VirtualTable).focus()

    @property
    def narrow(self) -> bool:
        return self.data.two and (self.size.width or self.app.size.width) < NARROW

    def _fit(self) -> None:
        """The token table keeps TABLE_LINES lines: the top-k panel shows as many candidates as fit
        below it, and a narrow terminal gets the columns that matter (and no Δ columns in the top-k)."""
        h = self.size.height or self.app.size.height
        title = self.query_one("#token-title", Static)
        title_lines = max(1, title.size.height) if title.size.height else 2
        fixed = 2 + title_lines + 2 + len(self.data.traces)  # header, footer, title, prompt, legend, texts
        panel = self.query_one("#topk", TopKPanel)
        panel.max_rows = max(2, h - fixed - TABLE_LINES - 4)  # 4: border, title, side titles, header
        panel.narrow = self.narrow

    def on_resize(self) -> None:
        narrow = self.query_one("#topk", TopKPanel).narrow
        self._fit()
        if self.al is not None:
            if narrow != self.narrow:
                self.table.set_rows(len(self.al), self._render_row, self._columns())
            self._show_topk(self.table.cursor)

    @property
    def table(self) -> VirtualTable:
        return self.query_one("#tokens", VirtualTable)

    def show_request(self, request_id: str, position: int | None = None) -> None:
        self.request_id = request_id
        self.browser.current_request = request_id
        self.al = self.data.tokens(request_id)
        self._title()
        legend = S.margin_legend()
        if self.data.two:
            legend.append("   ")
            legend.append_text(S.marks_legend(True))
        self.query_one("#token-legend", Static).update(legend)
        row = self.al.row_of_position(position) if position is not None else None
        if row is None:
            row = self._default_row()
        self.table.set_rows(len(self.al), self._render_row, self._columns(), cursor=row)
        self.table.move_cursor(row)
        self._show_topk(row)

    def _default_row(self) -> int:
        al = self.al
        for r in (al.first_divergent, al.first_numeric):
            if r is not None:
                return r
        return 0

    def _title(self) -> None:
        d, al = self.data, self.al
        t = Text(f"{self.request_id}", style="bold")
        t.append(f" · prompt {al.prompt_len} tokens")
        for s in d.sides:
            t.append(f" · {d.label(s)} {int(al.present[s].sum())} tokens")
        if d.two:
            rd = d.request_diff(self.request_id)
            if rd is None and not d.analysed:
                t.append(" · analysing…", style="dim")
            if al.first_divergent is not None:
                p = int(al.positions[al.first_divergent])
                t.append(f" · first divergent token at {p} (#{p - al.prompt_len})", style="bold red")
            elif d.analysed:
                t.append(" · identical tokens", style="green")
            if al.first_numeric is not None:
                t.append(f" · first numeric Δ at {int(al.positions[al.first_numeric])}", style="yellow")
            c = d.cause(self.request_id)
            if c is not None:
                t.append(f" · root cause: B step {c.b.step}", style="red")
        self.query_one("#token-title", Static).update(t)
        prompt = Text("prompt: ", style="dim", no_wrap=True, overflow="ellipsis")
        prompt.append(d.prompt_text(self.request_id).replace("\n", "⏎")[:1000], style="italic")
        self.query_one("#token-prompt", Static).update(prompt)

    def refresh_data(self) -> None:
        self._title()

    def _columns(self) -> list[Column]:
        cols = [Column("", 1), Column("pos", 6, "right"), Column("gen", 5, "right")]
        if not self.data.two:
            return cols + [Column("step", 6, "right"), Column("id", 6, "right"), Column("text", 16),
                           Column("margin", 9, "right"), Column("top-1 logit", 12, "right")]
        for s in "AB":
            cols += [Column(f"{s} step", 6, "right"), Column(f"{s} id", 6, "right"), Column(f"{s} text", 12),
                     Column(f"{s} margin", 9, "right")]
        cols += [Column("max |Δlogit|", 12, "right")]
        if self.narrow:
            cols = [cols[i] for i in NARROW_KEEP]
            cols = [c._replace(width=5) if c.label.endswith(" id") else c._replace(width=8, label=f"{c.label[0]} marg.")
                    if c.label.endswith("margin") else c._replace(label="max |Δ|", width=9) if c.label.startswith("max")
                    else c for c in cols]
        return cols

    def _side_cells(self, s: int, i: int, differs: bool) -> list:
        al = self.al
        if not al.present[s, i]:
            return ["", "", Text("—", style="dim"), ""]
        tok = int(al.tokens[s, i])
        m = float(al.margins[s, i])
        text = Text(self.data.text(tok), style=S.margin_style(m))
        if differs:
            text.stylize("bold underline")
        return [str(int(al.steps[s, i])), Text(str(tok), style=S.SIDE_DIFFERS if differs else ""), text,
                Text(S.fmt_margin(m), style=S.margin_style(m))]

    def _render_row(self, i: int):
        al = self.al
        pos = int(al.positions[i])
        mark, row_style = " ", None
        if al.two:
            if i == al.first_divergent:
                mark, row_style = S.FIRST_DIVERGENT, S.DIVERGED_ROW
            elif i == al.first_numeric:
                mark = S.FIRST_NUMERIC
            elif al.differs[i]:
                mark = S.TOKEN_DIFFERS
            elif al.numeric[i]:
                mark = S.LOGITS_DIFFER
        mark_style = {S.FIRST_DIVERGENT: "bold red", S.FIRST_NUMERIC: "bold yellow", S.TOKEN_DIFFERS: "red",
                      S.LOGITS_DIFFER: "yellow"}.get(mark, "")
        cells = [Text(mark, style=mark_style), str(pos), str(pos - al.prompt_len)]
        differs = bool(al.differs[i]) if al.two else False
        cells += self._side_cells(A, i, differs)
        if not al.two:
            return cells + [f"{float(al.top1[A, i]):.6f}"], row_style
        cells += self._side_cells(B, i, differs)
        dl = al.max_delta(i)
        cells.append(Text(fmt_delta(dl).lstrip("+") if dl else ("0" if al.present[:, i].all() else ""),
                          style="yellow" if dl else "dim"))
        if self.narrow:
            cells = [cells[k] for k in NARROW_KEEP]
        return cells, row_style

    @on(RowHighlighted, "#tokens")
    def _highlighted(self, event: RowHighlighted) -> None:
        self._show_topk(event.row)

    def _show_text(self, row: int) -> None:
        """Each side's text around the cursor: what was generated up to it, the token, what follows."""
        widget = self.query_one("#token-text", Static)
        al, d = self.al, self.data
        if al is None or not len(al):
            widget.update("", layout=False)
            return
        half = max(20, (self.size.width - 20) // 2)
        out = Text(no_wrap=True, overflow="ellipsis")
        for s in d.sides:
            if s:
                out.append("\n")
            out.append(f"{'AB'[s]} ", style="bold")
            lo, hi = max(0, row - half), min(len(al), row + half)
            before = d.decoded(self.request_id, s, lo, row).replace("\n", "⏎")[-half:]
            after = d.decoded(self.request_id, s, row + 1, hi).replace("\n", "⏎")
            out.append(("…" if lo or len(before) == half else "") + before, style="dim")
            here = d.piece(int(al.tokens[s, row])) if al.present[s, row] else None
            differs = al.two and bool(al.differs[row])
            out.append((here or "∅").replace("\n", "⏎"), style="bold reverse red" if differs else "bold reverse")
            out.append(after[:half], style="dim")
        widget.update(out, layout=False)

    def _show_topk(self, row: int) -> None:
        self._show_text(row)
        routing = self.query_one("#routing", RoutingPanel)
        if self.al is not None and len(self.al):
            self.query_one("#topk", TopKPanel).show(self.data.topk(self.request_id, row))
            routing.show(self.data.routing(self.request_id, int(self.al.positions[row])),
                         [self.data.label(s) for s in self.data.sides])
        else:
            self.query_one("#topk", TopKPanel).show(None)
            routing.show(None, [])

    @on(RowSelected, "#tokens")
    def _selected(self, event: RowSelected) -> None:
        self.action_step(B if self.data.two else A)

    # -- actions --
    @property
    def cursor_position(self) -> int | None:
        if self.al is None or not len(self.al):
            return None
        return int(self.al.positions[self.table.cursor])

    def action_step(self, side: int) -> None:
        if side >= len(self.data.traces) or not len(self.al):
            return
        i = self.table.cursor
        if not self.al.present[side, i]:
            self.notify(f"{self.data.label(side)} has no token at this position", severity="warning")
            return
        self.post_message(OpenStep(side, int(self.al.steps[side, i])))

    def action_first_divergent(self) -> None:
        if self.al.first_divergent is None:
            self.notify("the tokens of A and B are identical", severity="information")
            return
        self.table.move_cursor(self.al.first_divergent)

    def action_first_numeric(self) -> None:
        if self.al.first_numeric is None:
            self.notify("the stored logits of A and B are bitwise equal", severity="information")
            return
        self.table.move_cursor(self.al.first_numeric)

    def goto(self, text: str) -> str | None:
        text = text.strip()
        try:
            pos = self.al.prompt_len + int(text[1:]) if text.startswith("#") else int(text)
        except ValueError:
            return f"not a position: {text!r}"
        row = self.al.row_of_position(pos)
        if row is None:
            return f"no generated token at position {pos}"
        self.table.move_cursor(row)
        return None

    def search(self, text: str, *, again: bool = False) -> str | None:
        self._search = text or self._search
        q = self._search
        if not q:
            return None
        al, d = self.al, self.data
        n = len(al)
        start = self.table.cursor + (1 if again else 0)
        for k in range(n):
            i = (start + k) % n
            for s in d.sides:
                if al.present[s, i] and q in (d.piece(int(al.tokens[s, i])) or ""):
                    self.table.move_cursor(i)
                    return None
        return f"no token contains {q!r}"

    def action_search_again(self) -> None:
        err = self.search("", again=True)
        if err:
            self.notify(err, severity="warning")
