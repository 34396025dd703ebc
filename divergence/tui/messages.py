"""Messages between the browser's widgets, screens, workers and the app: small dataclasses."""
from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message
from textual.widget import Widget


@dataclass
class TableRowMessage(Message):
    """Something happened at a VirtualTable's `row` (the table is the message's control)."""

    table: Widget
    row: int

    @property
    def control(self) -> Widget:
        return self.table


@dataclass
class RowHighlighted(TableRowMessage):
    """A VirtualTable's cursor moved to `row`."""


@dataclass
class RowSelected(TableRowMessage):
    """Enter (or a click on the cursor row) on a VirtualTable's `row`."""


@dataclass
class CellHighlighted(Message):
    """The KV grid's cursor moved to (layer row, position)."""

    grid: Widget
    layer_row: int
    position: int

    @property
    def control(self) -> Widget:
        return self.grid


@dataclass
class CountsReady(Message, bubble=False):
    """The worker counted every request's tokens."""


@dataclass
class AnalysisReady(Message, bubble=False):
    """The worker finished diff + bisect (results are on the app's BrowseData)."""

    error: str | None = None


@dataclass
class KernelsReady(Message, bubble=False):
    """One side's kernel table has been read (the step timeline can show kernels)."""

    side: int


@dataclass
class KvGridReady(Message, bubble=False):
    """A request's KV grid, computed in a worker."""

    request_id: str
    at_steps: tuple
    grid: object  # data.KvGrid


@dataclass
class OpenRequest(Message):
    """Show a request's tokens (optionally at a position)."""

    request_id: str
    position: int | None = None


@dataclass
class OpenStep(Message):
    """Show the step timeline of one side at a step."""

    side: int
    step: int


@dataclass
class OpenKv(Message):
    """Show a request's KV grid (optionally at a layer row and position)."""

    request_id: str
    position: int | None = None
