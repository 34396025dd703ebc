"""One request's KV cache, layer x position: where A's and B's written bytes differ."""
from __future__ import annotations

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import Footer, Header, Static

from ..data import A, B, KvGrid
from ..messages import CellHighlighted, KvGridReady, OpenStep
from ..widgets import kv_grid as G
from ..widgets.kv_grid import KvGridView
from .base import RequestScreen


class KvScreen(RequestScreen):
    HELP = "one request's KV cache, layer x position; cells where A's and B's hashes differ"
    GOTO_PROMPT = "position (or L<layer>:<position>)"
    PAIR_ACTIONS = ("earliest", "toggle_at")
    BINDINGS = [
        Binding("d", "earliest", "earliest Δ"),
        Binding("e", "toggle_at", "at divergence / end"),
        Binding("a", "step(0)", "A's write"),
        Binding("b", "step(1)", "B's write"),
        Binding("enter", "step(-1)", "write step", show=False),
    ]

    def __init__(self, request_id: str, position: int | None = None):
        super().__init__(request_id, position)
        self.at_steps: tuple = (None, None)
        self.grid: KvGrid | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="kv-title")
        yield Static(id="kv-legend")
        yield KvGridView(id="kv")
        yield Static(id="kv-detail")
        yield Footer()

    @property
    def view(self) -> KvGridView:
        return self.query_one("#kv", KvGridView)

    def on_mount(self) -> None:
        legend = Text("  ")
        if self.data.two:
            legend.append(f"{G.SAME} same  ", "green")
            legend.append(f"{G.DIFFER} hashes differ  ", "red")
            legend.append(f"{G.ONE_SIDED} written on one side only  ", "yellow")
            legend.append(f"{G.EARLIEST} earliest differing cell  ", "bold white on red")
        else:
            legend.append(f"{G.SAME} written  ")
        legend.append("─ prompt  ━ generated", "dim")
        self.query_one("#kv-legend", Static).update(legend)
        self.show_request(self.request_id, self.start_position)
        self.view.focus()

    def show_request(self, request_id: str, position: int | None = None, at_steps: tuple | None = None) -> None:
        self.request_id = request_id
        self.browser.current_request = request_id
        self.start_position = position
        self.at_steps = at_steps if at_steps is not None else (
            self.data.kv_default_steps(request_id) if self.data.two else (None, None))
        self.query_one("#kv-title", Static).update(Text(f"{request_id} · reading the KV writes…", style="dim"))
        self.load(request_id, self.at_steps)

    @work(thread=True, exclusive=True, group="kv")
    def load(self, request_id: str, at_steps: tuple) -> None:
        grid = self.data.kv_grid(request_id, at_steps)
        self.post_message(KvGridReady(request_id, at_steps, grid))

    def on_kv_grid_ready(self, message: KvGridReady) -> None:
        if message.request_id != self.request_id or message.at_steps != self.at_steps:
            return
        self.grid = g = message.grid
        cursor = None
        if self.start_position is not None and len(g.positions):
            cursor = (0, min(self.start_position, len(g.positions) - 1))
        self.view.show(g, cursor)
        self._title()
        self._detail(*self.view.cursor)

    def refresh_data(self) -> None:
        if self.data.two and self.at_steps == (None, None):
            at = self.data.kv_default_steps(self.request_id)
            if at != self.at_steps:
                self.show_request(self.request_id, self.start_position, at)

    def _title(self) -> None:
        g, d = self.grid, self.data
        t = Text(self.request_id, style="bold")
        L, P = len(g.layers), len(g.positions)
        if not P:
            t.append(" · no KV writes recorded (a trace run with --no-kv-hashes?)", style="yellow")
            self.query_one("#kv-title", Static).update(t)
            return
        t.append(f" · {L} layers × {P} positions (prompt {g.prompt_len})")
        if g.at_steps == (None, None):
            t.append(" · live writes at the end of the run")
        else:
            t.append(" · as read by the divergent step ("
                     + ", ".join(f"{'AB'[s]} step {g.at_steps[s]}" for s in d.sides) + ")", style="yellow")
        if g.two:
            n, of = g.read_count()
            read = f" (positions < {g.read_before}, what it read)" if g.read_before is not None else ""
            t.append(f" · {n} of {of} cells differ{read}", style="red" if n else "green")
            if g.earliest is not None:
                lr, p = g.earliest
                t.append(f"\nearliest: layer {int(g.layers[lr])} position {p}, written by "
                         f"B step {int(g.step[B, lr, p])} (A step {int(g.step[A, lr, p])})", style="bold red")
        self.query_one("#kv-title", Static).update(t)

    @on(CellHighlighted, "#kv")
    def _cell(self, event: CellHighlighted) -> None:
        self._detail(event.layer_row, event.position)

    def _detail(self, layer_row: int, position: int) -> None:
        g, d = self.grid, self.data
        if g is None or not len(g.positions):
            self.query_one("#kv-detail", Static).update("no KV writes recorded for this request")
            return
        where = "prompt" if position < g.prompt_len else f"generated #{position - g.prompt_len}"
        t = Text(f"layer {int(g.layers[layer_row])} · position {position} ({where})", style="bold")
        if g.two:
            if g.differs[layer_row, position]:
                t.append(" · differs", style="bold red")
            elif g.one_sided[layer_row, position]:
                t.append(" · written on one side only", style="yellow")
        for s in d.sides:
            step = int(g.step[s, layer_row, position])
            t.append(f"\n{d.label(s):<14}")
            if step < 0:
                t.append("not written", style="dim")
            else:
                t.append(f"step {step:<6} k {int(g.k_hash[s, layer_row, position]):016x}  "
                         f"v {int(g.v_hash[s, layer_row, position]):016x}")
        self.query_one("#kv-detail", Static).update(t, layout=False)

    # -- actions --
    def action_earliest(self) -> None:
        if self.grid is None or self.grid.earliest is None:
            self.notify("no cell differs", severity="information")
            return
        self.view.cursor = self.grid.earliest

    def action_toggle_at(self) -> None:
        if not self.data.two:
            return
        default = self.data.kv_default_steps(self.request_id)
        at = (None, None) if self.at_steps != (None, None) else default
        if at == self.at_steps:
            self.notify("no numeric divergence: showing the end of the run", severity="information")
            return
        self.show_request(self.request_id, self.view.cursor[1], at)

    def action_step(self, side: int) -> None:
        if self.grid is None or not len(self.grid.positions):
            return
        side = (B if self.data.two else A) if side < 0 else side
        if side >= len(self.data.traces):
            return
        lr, p = self.view.cursor
        step = int(self.grid.step[side, lr, p])
        if step < 0:
            self.notify(f"{self.data.label(side)} has no write here", severity="warning")
            return
        self.post_message(OpenStep(side, step))

    def goto(self, text: str) -> str | None:
        if self.grid is None:
            return "still reading"
        text = text.strip()
        layer_row = self.view.cursor[0]
        try:
            if text.upper().startswith("L") and ":" in text:
                layer, text = text[1:].split(":", 1)
                rows = [i for i, x in enumerate(self.grid.layers) if int(x) == int(layer)]
                if not rows:
                    return f"no layer {layer}"
                layer_row = rows[0]
            pos = int(text)
        except ValueError:
            return f"not a position: {text!r}"
        if not 0 <= pos < len(self.grid.positions):
            return f"no position {pos} (0..{len(self.grid.positions) - 1})"
        self.view.cursor = (layer_row, pos)
        return None
