"""A table of any length: rows are rendered only when they scroll into view (Line API)."""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from rich.style import Style
from rich.text import Text
from textual import events
from textual.binding import Binding
from textual.cache import LRUCache
from textual.geometry import Size
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip

from ..messages import RowHighlighted, RowSelected

Cell = "Text | str"
MIN_FLEX = 8
RowRenderer = Callable[[int], "tuple[list[Text | str], Style | str | None]"]


class Column(NamedTuple):
    label: str
    width: int  # 0: take the width left over (at least `least`)
    justify: str = "left"  # left | right | center
    least: int = MIN_FLEX  # a flexible column's narrowest width


def fit(label: str, texts, *, least: int = 1, most: int = 80) -> int:
    """A column width that holds the label and every text (clamped to least..most)."""
    return max(least, min(most, max([len(label)] + [len(t) for t in texts])))


class VirtualTable(ScrollView, can_focus=True):
    """Columns of fixed width, a header that stays put, a cursor row.

    `render_row(i)` returns the cells of row i and a style for the whole row;
    it is called only for rows on screen (and cached until `refresh_rows`).
    """

    COMPONENT_CLASSES = {"vtable--header", "vtable--cursor", "vtable--cursor-blurred"}
    DEFAULT_CSS = """
    VirtualTable { height: 1fr; }
    VirtualTable > .vtable--header { text-style: bold; background: $panel; color: $text; }
    VirtualTable > .vtable--cursor { background: $block-cursor-background; color: $block-cursor-foreground;
                                     text-style: bold; }
    VirtualTable > .vtable--cursor-blurred { background: $block-cursor-blurred-background; }
    """
    BINDINGS = [
        Binding("up", "cursor(-1)", "up", show=False),
        Binding("down", "cursor(1)", "down", show=False),
        Binding("pageup", "page(-1)", "page up", show=False),
        Binding("pagedown", "page(1)", "page down", show=False),
        Binding("home", "edge(0)", "first", show=False),
        Binding("end", "edge(1)", "last", show=False),
        Binding("left", "scroll_left", "left", show=False),
        Binding("right", "scroll_right", "right", show=False),
        Binding("enter", "select", "select", show=False),
    ]

    cursor: reactive[int] = reactive(0, always_update=True, init=False)

    def __init__(self, columns: list[Column] = (), *, row_count: int = 0, render_row: RowRenderer | None = None,
                 name: str | None = None, id: str | None = None, classes: str | None = None):
        super().__init__(name=name, id=id, classes=classes)
        self.columns = list(columns)
        self.row_count = row_count
        self.render_row = render_row or (lambda i: ([], None))
        self._cache: LRUCache[tuple, Strip] = LRUCache(1024)
        self._center_pending = False  # move_cursor(center=True) before the table had a size

    # -- content --
    def _widths(self) -> list[int]:
        fixed = sum(c.width for c in self.columns) + max(0, len(self.columns) - 1)
        flex = [c for c in self.columns if not c.width]
        spare = self.scrollable_content_region.width - fixed if self.is_mounted else 0
        each = spare // len(flex) if flex else 0
        return [c.width or max(c.least, each) for c in self.columns]

    @property
    def content_width(self) -> int:
        return sum(self._widths()) + max(0, len(self.columns) - 1)

    def on_resize(self) -> None:
        self._cache.clear()
        self.virtual_size = Size(self.content_width, self.row_count + 1)
        # a cursor placed before the table had its size (a screen opening on row 127) comes into view
        self.call_after_refresh(self._cursor_into_view)

    def _cursor_into_view(self) -> None:
        if not self.row_count or not self.scrollable_content_region.height:
            return
        center, self._center_pending = self._center_pending, False
        top = round(self.scroll_y)
        if center or not top <= self.cursor < top + self.page_rows:
            self.scroll_to_row(self.cursor, center=True)

    def set_rows(self, row_count: int, render_row: RowRenderer | None = None, columns: list[Column] | None = None,
                 *, cursor: int | None = None) -> None:
        if columns is not None:
            self.columns = list(columns)
        if render_row is not None:
            self.render_row = render_row
        self.row_count = row_count
        self._cache.clear()
        self.virtual_size = Size(self.content_width, row_count + 1)
        target = self.cursor if cursor is None else cursor
        self.cursor = max(0, min(target, row_count - 1)) if row_count else 0
        self.refresh()

    def refresh_rows(self) -> None:
        """Re-render every row (the data behind them changed)."""
        self._cache.clear()
        self.refresh()

    def on_mount(self) -> None:
        self.virtual_size = Size(self.content_width, self.row_count + 1)

    # -- cursor --
    @property
    def page_rows(self) -> int:
        return max(1, self.scrollable_content_region.height - 1)

    def validate_cursor(self, value: int) -> int:
        return max(0, min(value, self.row_count - 1)) if self.row_count else 0

    def watch_cursor(self, old: int, new: int) -> None:
        # no cache to clear: cached lines are keyed by whether they hold the cursor
        self.scroll_to_row(new)
        self.refresh()
        if self.row_count:
            self.post_message(RowHighlighted(self, new))

    def scroll_to_row(self, row: int, *, center: bool = False) -> None:
        top = round(self.scroll_y)
        page = self.page_rows
        if center:
            self.scroll_to(y=max(0, row - page // 2), animate=False, immediate=True)
        elif row < top:
            self.scroll_to(y=row, animate=False, immediate=True)
        elif row >= top + page:
            self.scroll_to(y=row - page + 1, animate=False, immediate=True)

    def move_cursor(self, row: int, *, center: bool = True) -> None:
        row = self.validate_cursor(row)
        if center:
            if not self.scrollable_content_region.height:
                self._center_pending = True
            self.scroll_to_row(row, center=True)
        self.cursor = row

    def action_cursor(self, delta: int) -> None:
        self.cursor = self.cursor + delta

    def action_page(self, direction: int) -> None:
        self.cursor = self.cursor + direction * self.page_rows

    def action_edge(self, end: int) -> None:
        self.cursor = self.row_count - 1 if end else 0

    def action_select(self) -> None:
        if self.row_count:
            self.post_message(RowSelected(self, self.cursor))

    def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None or offset.y < 1:
            return
        row = round(self.scroll_y) + offset.y - 1
        if 0 <= row < self.row_count:
            if row == self.cursor and event.chain > 1:
                self.action_select()
            self.cursor = row

    def on_focus(self) -> None:
        self.refresh()

    def on_blur(self) -> None:
        self.refresh()

    # -- rendering --
    def _line(self, cells: list, base: Style, overlay: Style | None = None) -> Strip:
        line = Text(no_wrap=True, end="", style=base)
        for i, (col, width) in enumerate(zip(self.columns, self._widths())):
            cell = cells[i] if i < len(cells) else ""
            t = cell.copy() if isinstance(cell, Text) else Text(str(cell))
            t.no_wrap = True
            if t.cell_len > width:
                t.truncate(width, overflow="ellipsis")
            t.align(col.justify, width)
            line.append_text(t)
            if i < len(self.columns) - 1:
                line.append(" ")
        if overlay is not None:
            line.stylize(overlay)
        return Strip(line.render(self.app.console), line.cell_len)

    def _row_strip(self, row: int) -> Strip:
        is_cursor = row == self.cursor
        key = (row, is_cursor, self.has_focus)
        strip = self._cache.get(key)
        if strip is None:
            cells, style = self.render_row(row)
            base = self.rich_style
            if style:
                base = base + (Style.parse(style) if isinstance(style, str) else style)
            overlay = None
            if is_cursor:
                cls = "vtable--cursor" if self.has_focus else "vtable--cursor-blurred"
                overlay = self.get_component_rich_style(cls, partial=True)
            strip = self._line(cells, base, overlay)
            self._cache[key] = strip
        return strip

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        width = self.scrollable_content_region.width
        if y == 0:
            header = self._line([c.label for c in self.columns],
                                self.rich_style + self.get_component_rich_style("vtable--header", partial=True))
            return header.crop_extend(scroll_x, scroll_x + width, self.get_component_rich_style("vtable--header"))
        row = scroll_y + y - 1
        if row >= self.row_count:
            return Strip.blank(width, self.rich_style)
        return self._row_strip(row).crop_extend(scroll_x, scroll_x + width, self.rich_style)
