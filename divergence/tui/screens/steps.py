"""Step timeline of one trace: every forward pass, who was in it, which kernels ran."""
from __future__ import annotations

import numpy as np
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import Footer, Header, Static

from .. import styles as S
from ..data import B, OP_CLASSES, StepMark
from ..messages import KernelsReady, OpenRequest, RowHighlighted, RowSelected
from ..widgets.virtual_table import Column, VirtualTable
from .base import BrowseScreen


MAX_SLICES = 9  # lines of the detail panel's tables (it has a fixed height)
NARROW = 100  # below this width: no ms column, narrower detail tables
KERNEL_MOST = 24  # a kernel column is never wider


class StepScreen(BrowseScreen):
    HELP = "every engine step of one trace: rows, phases, co-batched requests, kernel per op class"
    GOTO_PROMPT = "step index"
    SEARCH_PROMPT = "request id (steps that hold it)"
    PAIR_ACTIONS = ("root_cause",)
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
        self.marks: dict[int, list[StepMark]] = {}
        self._search = ""
        self.kernel_widths: dict[int, dict[str, int]] = {}  # side -> op class -> width

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
        self._fit()
        self.show_side(self.side, self.start_step)
        self.table.focus()

    @property
    def narrow(self) -> bool:
        return (self.size.width or self.app.size.width) < NARROW

    def _detail_lines(self) -> int:
        """Lines of the detail panel's tables: all MAX_SLICES on a tall terminal; on a short one the
        timeline keeps about two thirds of the screen."""
        h = self.size.height or self.app.size.height
        return max(2, min(MAX_SLICES, h // 3 - 3))

    def _fit(self) -> None:
        self.query_one("#step-detail", Static).styles.height = self._detail_lines() + 3  # border, title, header

    def on_resize(self) -> None:
        self._fit()
        cols = self._columns()
        if cols != self.table.columns:
            self.table.set_rows(self.table.row_count, columns=cols)
        self._title()
        self._detail(self.table.cursor)

    def show_side(self, side: int, step: int | None = None) -> None:
        self.side = side
        idx = self.data.steps(side)
        if idx.kernels_ready and side not in self.kernel_widths:
            self.kernel_widths[side] = idx.kernel_widths()
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
        idx = self.data.steps(side)
        idx.load_kernels()
        self.kernel_widths[side] = idx.kernel_widths()
        self.app.post_message(KernelsReady(side))  # the app tells every screen

    def on_kernels_ready(self, message: KernelsReady) -> None:
        if message.side == self.side:
            if self.side not in self.kernel_widths:  # another screen's worker read them
                self.kernel_widths[self.side] = self.data.steps(self.side).kernel_widths()
            self.table.set_rows(self.table.row_count, columns=self._columns())
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
        """One line when it fits (the file name is in the app's header), else the marks on a second;
        each line cut at the edge, never wrapped mid-phrase."""
        d = self.data
        idx = d.steps(self.side)
        head = Text(f"{d.label(self.side)}", style="bold")
        head.append(f" · {len(idx)} steps")
        rid = self.browser.current_request
        head.append(f" · {S.IN_STEP} holds {rid}", style="cyan")
        marks: list[Text] = []
        others = 0
        for step, why in sorted(self.marks.items()):
            for m in why:
                if m.request_id != rid:
                    others += 1
                    continue
                mark = S.ROOT_CAUSE if m.root else S.DIVERGENT_STEP
                marks.append(Text(f"{mark} step {step}: {m.text}", style="red" if m.root else "yellow"))
        if others:
            marks.append(Text(f"{others} marks of other requests", style="dim"))
        if d.two and not d.analysed:
            marks.append(Text("analysing…", style="dim"))
        tail = Text(" · ").join(marks)
        width = (self.size.width or self.app.size.width) - 2  # padding
        t = head.copy()
        if marks and head.cell_len + 3 + tail.cell_len <= width:
            t.append(" · ")
            t.append_text(tail)
        elif marks:
            t.append("\n")
            t.append_text(tail)
        lines = t.split("\n")
        for line in lines:
            line.truncate(width, overflow="ellipsis")
        self.query_one("#steps-title", Static).update(Text("\n").join(lines))

    def _columns(self) -> list[Column]:
        """The kernel columns as wide as their widest label (once the kernel table is read); the
        composition takes the rest."""
        widths = self.kernel_widths.get(self.side, {})
        kern = [Column(n, max(len(n), min(KERNEL_MOST, widths[n])) if widths.get(n) else 11)
                for n, _ in OP_CLASSES]
        ms = [] if self.narrow else [Column("ms", 7, "right")]
        return [Column("", 1), Column("", 1), Column("step", 6, "right"), Column("model", 6),
                Column("rows", 5, "right")] + ms + [Column("composition", 0, least=20)] + kern

    def _render_row(self, i: int):
        idx = self.data.steps(self.side)
        r = idx.row(i)
        why = self.marks.get(r.step, [])
        mark, style = " ", None
        if any(m.root for m in why):
            mark, style = S.ROOT_CAUSE, S.ROOT_CAUSE_ROW
        elif why:
            mark, style = S.DIVERGENT_STEP, S.DIVERGENT_STEP_ROW
        here = S.IN_STEP if self.browser.current_request in r.requests else " "
        k = r.kernels
        kernels = [k.get(n, "") for n, _ in OP_CLASSES] if k is not None else ["…"] * len(OP_CLASSES)
        kcells = [Text(x, style="magenta" if x.startswith("gemm") else "") for x in kernels]
        ms = [] if self.narrow else [f"{r.duration_ms:.1f}"]
        return [mark, Text(here, style="cyan"), str(r.step), r.model, str(r.rows)] + ms + [r.composition] + kcells, style

    @on(RowHighlighted, "#steps")
    def _highlighted(self, event: RowHighlighted) -> None:
        self._detail(event.row)

    @on(RowSelected, "#steps")
    def _selected(self, event: RowSelected) -> None:
        self.action_token()

    def _detail(self, row: int) -> None:
        d = self.data
        widget = self.query_one("#step-detail", Static)
        if not len(d.steps(self.side)):
            widget.update("no steps")
            return
        det = d.step_detail(self.side, row)
        text = Text(f"step {det.step} ({det.model}) · {det.rows} rows · {det.duration_ms:.2f} ms", style="bold")
        for m in det.marks:
            text.append(f"   {S.ROOT_CAUSE if m.root else S.DIVERGENT_STEP} {m.text}",
                        style="bold red" if m.root else "bold yellow")
        n = self._detail_lines()
        wl, wr = ((8, 7, 10, 9), (9, 6, 8, 12)) if self.narrow else ((10, 8, 13, 11), (10, 7, 8, 16))
        left = [S.cells(("request", wl[0]), ("phase", wl[1]), ("positions", wl[2]), ("rows", wl[3]))]
        shown = det.slices[:n] if len(det.slices) <= n else det.slices[:n - 1]
        for sl in shown:
            left.append(S.cells((sl["request_id"], wl[0]), (sl["phase"], wl[1]),
                                (f"{sl['start']}..{sl['start'] + sl['count'] - 1}", wl[2]),
                                (f"{sl['row_offset']}..{sl['row_offset'] + sl['count'] - 1}", wl[3])))
        if len(det.slices) > len(shown):
            left.append(Text(f"… {len(det.slices) - len(shown)} more slices", style="dim"))
        right = [S.cells(("op", wr[0]), ("layers", wr[1]), ("kernel", wr[2]), ("M×N×K", wr[3]))]
        if not d.steps(self.side).kernels_ready:
            right.append(Text("reading the kernel table…", style="dim"))
        kernels = det.kernels[:n] if len(det.kernels) <= n else det.kernels[:n - 1]
        for k in kernels:
            right.append(S.cells((k.op, wr[0]), (k.layers, wr[1]),
                                 (Text(k.kernel, style="magenta" if k.kernel.startswith("gemm") else ""), wr[2]),
                                 (f"{k.m}×{k.n}×{k.k}", wr[3])))
        if len(det.kernels) > len(kernels):
            right.append(Text(f"… {len(det.kernels) - len(kernels)} more kernel rows", style="dim"))
        left[0].stylize("dim")
        right[0].stylize("dim")
        width = left[0].cell_len
        for i in range(max(len(left), len(right))):
            a = left[i].copy() if i < len(left) else Text()
            a.align("left", width)
            text.append("\n")
            text.append_text(a)
            text.append("  " if self.narrow else "    ")
            if i < len(right):
                text.append_text(right[i])
        widget.update(text, layout=False)

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
        if not len(idx):
            return
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

