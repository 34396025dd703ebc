"""What every browser screen shares: the data, the go-to prompt, hooks for worker results."""
from __future__ import annotations

from typing import TYPE_CHECKING

from textual.screen import Screen

from ..messages import AnalysisReady, CountsReady, KernelsReady

if TYPE_CHECKING:
    from ..app import BrowseApp
    from ..data import BrowseData


class BrowseScreen(Screen):
    HELP: str = ""  # one line for the help screen
    GOTO_PROMPT: str = ""  # what `g` asks for on this screen ("" = nothing to go to)
    SEARCH_PROMPT: str = ""  # what `/` searches on this screen
    PAIR_ACTIONS: tuple = ()  # actions that need two traces (hidden with one)

    @property
    def browser(self) -> "BrowseApp":
        return self.app  # type: ignore[return-value]

    @property
    def data(self) -> "BrowseData":
        return self.browser.data

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        if not self.data.two and (action in self.PAIR_ACTIONS or parameters == (1,)):
            return False
        return True

    def goto(self, text: str) -> str | None:
        """Go to what the user typed; return an error text when it names nothing here."""
        return "nothing to go to here"

    def search(self, text: str, *, again: bool = False) -> str | None:
        return "nothing to search here"

    def on_analysis_ready(self, message: AnalysisReady) -> None:
        self.refresh_data()

    def on_counts_ready(self, message: CountsReady) -> None:
        self.refresh_data()

    def on_kernels_ready(self, message: KernelsReady) -> None:
        pass

    def refresh_data(self) -> None:
        """Token counts or the analysis (diff + bisect) arrived: redraw what depends on them."""


class RequestScreen(BrowseScreen):
    """A screen of one request (its tokens, its KV cache), opened at a position or at its start."""

    def __init__(self, request_id: str, position: int | None = None):
        super().__init__()
        self.request_id = request_id
        self.start_position = position
