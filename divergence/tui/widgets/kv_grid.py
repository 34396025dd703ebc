"""Layer x position grid of one request's KV cache: which cells differ between A and B.

One character per position; only the visible window is rendered, so a
100,000-position request scrolls like a short one.
"""
from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
from textual.binding import Binding
from textual.geometry import Size
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip

from ..data import KvGrid
from ..messages import CellHighlighted

GUTTER = 6  # "L12  " on the left, never scrolled
HEADER = 2  # position ruler + prompt/generated ticks
SAME, DIFFER, ONE_SIDED, EARLIEST, EMPTY = "·", "█", "?", "◆", " "


class KvGridView(ScrollView, can_focus=True):
    COMPONENT_CLASSES = {"kv--same", "kv--differ", "kv--one-sided", "kv--earliest", "kv--cursor", "kv--ruler",
                         "kv--prompt", "kv--gutter"}
    DEFAULT_CSS = """
    KvGridView { height: 1fr; }
    KvGridView > .kv--same { color: $success 60%; }
    KvGridView > .kv--differ { color: $error; }
    KvGridView > .kv--one-sided { color: $warning; }
    KvGridView > .kv--earliest { color: $text; background: $error; text-style: bold; }
    KvGridView > .kv--cursor { text-style: reverse; }
    KvGridView > .kv--ruler { color: $text-muted; }
    KvGridView > .kv--prompt { color: $text-muted; }
    KvGridView > .kv--gutter { color: $text-muted; text-style: bold; }
    """
    BINDINGS = [
        Binding("left", "move(0, -1)", "←", show=False),
        Binding("right", "move(0, 1)", "→", show=False),
        Binding("up", "move(-1, 0)", "↑", show=False),
        Binding("down", "move(1, 0)", "↓", show=False),
        Binding("pageup", "page(-1)", "page left", show=False),
        Binding("pagedown", "page(1)", "page right", show=False),
        Binding("home", "edge(0)", "first position", show=False),
        Binding("end", "edge(1)", "last position", show=False),
    ]

    cursor: reactive[tuple[int, int]] = reactive((0, 0), always_update=True, init=False)

    def __init__(self, *, id: str | None = None):
        super().__init__(id=id)
        self.grid: KvGrid | None = None

    def show(self, grid: KvGrid, cursor: tuple[int, int] | None = None) -> None:
        self.grid = grid
        self.virtual_size = Size(GUTTER + len(grid.positions), HEADER + len(grid.layers))
        self.cursor = cursor if cursor is not None else (grid.earliest or (0, 0))
        self.refresh()

    @property
    def window(self) -> int:
        return max(1, self.scrollable_content_region.width - GUTTER)

    def validate_cursor(self, value: tuple[int, int]) -> tuple[int, int]:
        g = self.grid
        if g is None or not len(g.positions):
            return (0, 0)
        return (max(0, min(value[0], len(g.layers) - 1)), max(0, min(value[1], len(g.positions) - 1)))

    def watch_cursor(self, value: tuple[int, int]) -> None:
        if self.grid is None or not len(self.grid.positions):
            return
        layer_row, position = value
        left = round(self.scroll_x)
        if position < left or position >= left + self.window:
            self.scroll_to(x=max(0, position - self.window // 2), animate=False, immediate=True)
        top = round(self.scroll_y)
        rows = max(1, self.scrollable_content_region.height - HEADER)
        if layer_row < top or layer_row >= top + rows:
            self.scroll_to(y=max(0, layer_row - rows + 1), animate=False, immediate=True)
        self.refresh()
        self.post_message(CellHighlighted(self, layer_row, position))

    def action_move(self, d_layer: int, d_pos: int) -> None:
        self.cursor = (self.cursor[0] + d_layer, self.cursor[1] + d_pos)

    def action_page(self, direction: int) -> None:
        self.cursor = (self.cursor[0], self.cursor[1] + direction * self.window)

    def action_edge(self, end: int) -> None:
        self.cursor = (self.cursor[0], len(self.grid.positions) - 1 if end and self.grid else 0)

    def on_click(self, event) -> None:
        offset = event.get_content_offset(self)
        if offset is None or self.grid is None or offset.x < GUTTER or offset.y < HEADER:
            return
        self.cursor = (round(self.scroll_y) + offset.y - HEADER, round(self.scroll_x) + offset.x - GUTTER)

    def _style(self, name: str) -> Style:
        return self.get_component_rich_style(name)

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        base = self.rich_style
        g = self.grid
        if g is None or not len(g.positions):
            return Strip.blank(width, base)
        left = round(self.scroll_x)
        lo, hi = left, min(len(g.positions), left + self.window)
        if y == 0:
            return self._ruler(lo, hi, width)
        if y == 1:
            return self._ticks(g, lo, hi, width)
        row = round(self.scroll_y) + y - HEADER
        if row >= len(g.layers):
            return Strip.blank(width, base)
        segs = [Segment(f"L{int(g.layers[row])}".ljust(GUTTER), self._style("kv--gutter"))]
        styles = {k: self._style(f"kv--{k}") for k in ("same", "differ", "one-sided", "earliest", "prompt")}
        cursor_style = self._style("kv--cursor")
        written = g.step[:, row, lo:hi] >= 0
        differs, one_sided = g.differs[row, lo:hi], g.one_sided[row, lo:hi]
        run_text, run_style = [], None
        for i in range(hi - lo):
            p = lo + i
            if g.earliest == (row, p):
                ch, st = EARLIEST, styles["earliest"]
            elif differs[i]:
                ch, st = DIFFER, styles["differ"]
            elif one_sided[i]:
                ch, st = ONE_SIDED, styles["one-sided"]
            elif written[:, i].any():
                ch, st = SAME, styles["prompt"] if p < g.prompt_len else styles["same"]
            else:
                ch, st = EMPTY, base
            if self.cursor == (row, p):
                st = st + cursor_style
            if st is not run_style and run_text:
                segs.append(Segment("".join(run_text), run_style))
                run_text = []
            run_text.append(ch)
            run_style = st
        if run_text:
            segs.append(Segment("".join(run_text), run_style))
        return Strip(segs).crop_extend(0, width, base)

    def _ruler(self, lo: int, hi: int, width: int) -> Strip:
        chars = [" "] * (hi - lo)
        p = lo + (-lo) % 10
        while p < hi:
            label = str(p)
            for j, c in enumerate(label):
                if p - lo + j < len(chars):
                    chars[p - lo + j] = c
            p += 10
        segs = [Segment("pos".ljust(GUTTER), self._style("kv--gutter")), Segment("".join(chars), self._style("kv--ruler"))]
        return Strip(segs).crop_extend(0, width, self.rich_style)

    def _ticks(self, g: KvGrid, lo: int, hi: int, width: int) -> Strip:
        segs = [Segment("".ljust(GUTTER), self.rich_style)]
        n_prompt = max(0, min(hi, g.prompt_len) - lo)
        if n_prompt:
            segs.append(Segment("".join("┬" if (lo + i) % 10 == 0 else "─" for i in range(n_prompt)),
                                self._style("kv--prompt")))
        n_gen = hi - lo - n_prompt
        if n_gen > 0:
            start = lo + n_prompt
            segs.append(Segment("".join("┳" if (start + i) % 10 == 0 else "━" for i in range(n_gen)),
                                self._style("kv--ruler")))
        return Strip(segs).crop_extend(0, width, self.rich_style)
