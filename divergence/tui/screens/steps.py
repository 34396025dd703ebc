"""Step timeline of one trace: every forward pass, who was in it, which kernels ran."""
from __future__ import annotations

import numpy as np
from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import Footer, Header, Static

from .. import styles as S
from ..data import A, B, OP_CLASSES
from ..messages import KernelsReady, OpenRequest, RowHighlighted, RowSelected
from ..widgets.virtual_table import Column, VirtualTable
from .base import BrowseScreen


class StepScreen(BrowseScreen):
    HELP = "every engine step of one trace: rows, phases, co-batched requests, kernel per op class"
    GOTO_PROMPT = "step index"
    SEARCH_PROMPT = "request id (steps that hold it)"
    BINDINGS = [
        Binding("a", "side(0)", "A timeline"),
        Binding("b", "side(1)", "B timeline"),
        Binding("d", "root_cause", "root cause"),
        Binding("enter", "token", "token", show=False),
        Binding("n", "search_again", "next match", show=False),
    ]

    def __init__(self, side: int, step: int | None = None):
        super().__init__()
        self.side = side
        self.start_step = step
        self.marks: dict[int, list[str]] = {}
        self._search = ""

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="steps-title")
        yield VirtualTable(id="steps")
        yield Static(id="step-detail")
        yield Footer()

    @property
    def table(self) -> VirtualTable:
        return self.query_one("#steps", VirtualTable)

    def on_mount(self) -> None:
        self.show_side(self.side, self.start_step)
        self.table.focus()

    def show_side(self, side: int, step: int | None = None) -> None:
        self.side = side
        idx = self.data.steps(side)
        self.marks = self.data.step_marks(side)
        if step is None:
            step = self._root_step()
        row = idx.row_of_step(step) if step is not None else None
        self.table.set_rows(len(idx), self._render_row, self._columns(), cursor=row or 0)
        self.table.move_cursor(row or 0)
        self._title()
        self._detail(self.table.cursor)
        if not idx.kernels_ready:
            self.load_kernels(side)

    @work(thread=True, exclusive=True, group="kernels")
    def load_kernels(self, side: int) -> None:
        self.data.steps(side).load_kernels()
        self.post_message(KernelsReady(side))

    def on_kernels_ready(self, message: KernelsReady) -> None:
        if message.side == self.side:
            self.table.refresh_rows()
            self._detail(self.table.cursor)

    def refresh_data(self) -> None:
        self.marks = self.data.step_marks(self.side)
        self.table.refresh_rows()
        self._title()
        self._detail(self.table.cursor)

    def _root_step(self) -> int | None:
        c = self.data.cause(self.browser.current_request)
        if c is not None:
            return (c.b if self.side == B else c.a).step
        return None

    def _title(self) -> None:
        d = self.data
        idx = d.steps(self.side)
        t = Text(f"{d.label(self.side)}", style="bold")
        t.append(f" · {len(idx)} steps · {d.trace(self.side).path.name}")
        rid = self.browser.current_request
        t.append(f" · {S.IN_STEP} = holds {rid}", style="cyan")
        for step, why in sorted(self.marks.items()):
            for w in why:
                mark = S.ROOT_CAUSE if w.startswith("root") else S.DIVERGENT_STEP
                t.append(f" · {mark} step {step}: {w}", style="red" if mark == S.ROOT_CAUSE else "yellow")
        if d.two and not d.analysed:
            t.append(" · analysing…", style="dim")
        self.query_one("#steps-title", Static).update(t)

    def _columns(self) -> list[Column]:
        return [Column("", 1), Column("", 1), Column("step", 6, "right"), Column("model", 6), Column("rows", 5, "right"),
                Column("ms", 7, "right"), Column("composition", 44)] + [Column(n, 9) for n, _ in OP_CLASSES]

    def _render_row(self, i: int):
        idx = self.data.steps(self.side)
        r = idx.row(i)
        why = self.marks.get(r.step, [])
        mark, style = " ", None
        if any(w.startswith("root") for w in why):
            mark, style = S.ROOT_CAUSE, S.ROOT_CAUSE_ROW
        elif why:
            mark, style = S.DIVERGENT_STEP, S.DIVERGENT_STEP_ROW
        here = S.IN_STEP if self.browser.current_request in r.requests else " "
        k = r.kernels
        kernels = [k.get(n, "") for n, _ in OP_CLASSES] if k is not None else ["…"] * len(OP_CLASSES)
        kcells = [Text(x, style="magenta" if x.startswith("gemm") else "") for x in kernels]
        return [mark, Text(here, style="cyan"), str(r.step), r.model, str(r.rows), f"{r.duration_ms:.1f}",
                r.composition] + kcells, style

    @on(RowHighlighted, "#steps")
    def _highlighted(self, event: RowHighlighted) -> None:
        self._detail(event.row)

    @on(RowSelected, "#steps")
    def _selected(self, event: RowSelected) -> None:
        self.action_token()

    def _detail(self, row: int) -> None:
        d = self.data
        if not len(d.steps(self.side)):
            self.query_one("#step-detail", Static).update("no steps")
            return
        det = d.step_detail(self.side, row)
        parts = []
        head = Text(f"step {det.step} ({det.model}) · {det.rows} rows · {det.duration_ms:.2f} ms", style="bold")
        for w in det.marks:
            head.append(f"\n{S.ROOT_CAUSE if w.startswith('root') else S.DIVERGENT_STEP} {w}",
                        style="bold red" if w.startswith("root") else "bold yellow")
        parts.append(head)
        sl = Table(box=None, padding=(0, 1), show_edge=False, title_justify="left")
        for c in ("request", "phase", "positions", "rows"):
            sl.add_column(c)
        for s in det.slices:
            sl.add_row(s["request_id"], s["phase"], f"{s['start']}..{s['start'] + s['count'] - 1}",
                       f"{s['row_offset']}..{s['row_offset'] + s['count'] - 1}")
        kt = Table(box=None, padding=(0, 1), show_edge=False)
        for c in ("op", "layers", "kernel", "M×N×K"):
            kt.add_column(c)
        if not d.steps(self.side).kernels_ready:
            kt.add_row("…", "", "", "")
        for k in det.kernels:
            kt.add_row(k.op, k.layers, Text(k.kernel, style="magenta" if k.kernel.startswith("gemm") else ""),
                       f"{k.m}×{k.n}×{k.k}")
        grid = Table.grid(padding=(0, 4))
        grid.add_row(sl, kt)
        parts.append(grid)
        self.query_one("#step-detail", Static).update(Group(*parts))

    # -- actions --
    def action_side(self, side: int) -> None:
        if side >= len(self.data.traces):
            self.notify("only one trace is open", severity="warning")
            return
        if side != self.side:
            self.show_side(side)

    def action_root_cause(self) -> None:
        step = self._root_step()
        if step is None:
            self.notify(f"no root cause for {self.browser.current_request}", severity="information")
            return
        self.goto(str(step))

    def action_token(self) -> None:
        """Open the token the current request got from this step (or the step's first request's)."""
        idx = self.data.steps(self.side)
        r = idx.row(self.table.cursor)
        rid = self.browser.current_request if self.browser.current_request in r.requests else (
            r.requests[0] if r.requests else None)
        if rid is None:
            return
        al = self.data.tokens(rid)
        rows = (al.steps[self.side] == r.step).nonzero()[0]
        pos = int(al.positions[rows[0]]) if rows.size else None
        self.post_message(OpenRequest(rid, pos))

    def goto(self, text: str) -> str | None:
        try:
            step = int(text.strip())
        except ValueError:
            return f"not a step: {text!r}"
        row = self.data.steps(self.side).row_of_step(step)
        if row is None:
            return f"no step {step} in {self.data.label(self.side)}"
        self.table.move_cursor(row)
        return None

    def search(self, text: str, *, again: bool = False) -> str | None:
        self._search = text.strip() or self._search
        q = self._search
        idx = self.data.steps(self.side)
        if q not in self.data.request_ids:
            return f"no request {q!r}"
        rows = np.flatnonzero(np.isin(idx.index, idx.steps_of(q)))
        if not rows.size:
            return f"no step holds {q!r}"
        start = self.table.cursor + (1 if again else 0)
        after = rows[rows >= start]
        self.table.move_cursor(int(after[0] if after.size else rows[0]))
        return None

    def action_search_again(self) -> None:
        err = self.search("", again=True)
        if err:
            self.notify(err, severity="warning")


__all__ = ["StepScreen", "A", "B"]
