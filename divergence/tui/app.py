"""`divergence browse A.h5 [B.h5]`: the app, its navigation, and `run_browser` (the CLI's entry).

Screens: overview (default) → tokens of a request → step timeline → KV grid,
each jump pushed, so `esc` walks back. Diff + bisect run in a worker thread
as soon as the app starts; screens redraw when `AnalysisReady` arrives.
"""
from __future__ import annotations

import sys
from pathlib import Path

from textual import work
from textual.app import App
from textual.binding import Binding

from ..errors import DivergenceInputError
from .data import A, B, BrowseData
from .messages import AnalysisReady, CountsReady, KernelsReady, OpenKv, OpenRequest, OpenStep
from .screens.base import BrowseScreen
from .screens.goto import PromptScreen
from .screens.help import HelpScreen
from .screens.kv import KvScreen
from .screens.overview import OverviewScreen
from .screens.steps import StepScreen
from .screens.tokens import TokenScreen


class BrowseApp(App):
    CSS_PATH = Path(__file__).with_name("browse.tcss")  # absolute: subclasses live elsewhere
    TITLE = "divergence browse"
    ENABLE_COMMAND_PALETTE = False
    # o, / and esc are left out of the footer (the help lists every key): fewer footer widgets
    BINDINGS = [
        Binding("question_mark", "help", "help"),
        Binding("o", "overview", "overview", show=False),
        Binding("t", "tokens", "tokens"),
        Binding("s", "steps", "steps"),
        Binding("k", "kv", "KV"),
        Binding("g", "goto", "go to"),
        Binding("slash", "search", "search", show=False),
        Binding("escape", "back", "back", show=False),
        Binding("q", "quit", "quit"),
    ]

    def __init__(self, data: BrowseData, *, analyse: bool = True):
        super().__init__()
        self.data = data
        self.current_request: str = data.request_ids[0] if data.request_ids else ""
        self._analyse = analyse
        names = [t.path.name for t in data.traces]
        self.sub_title = " vs ".join(f"{'AB'[i]}: {n}" for i, n in enumerate(names))
        degrees = [t.tp_degree for t in data.traces]
        if len(set(degrees)) > 1:
            self.sub_title += f"  ·  tensor-parallel degrees differ: TP={degrees[0]} vs TP={degrees[1]}"

    def get_default_screen(self) -> OverviewScreen:
        return OverviewScreen()

    def on_mount(self) -> None:
        if self._analyse:
            self.analyse()

    # -- workers --
    @work(thread=True, exclusive=True, group="analysis")
    def analyse(self) -> None:
        """Count tokens (the overview's first paint doesn't wait for them), then diff and bisect."""
        self.data.count_tokens()
        self.post_message(CountsReady())
        if self.data.two:
            self.data.analyse()
            self.post_message(AnalysisReady(self.data.analysis_error))

    def on_counts_ready(self, message: CountsReady) -> None:
        for screen in self.screen_stack:
            if isinstance(screen, BrowseScreen):
                screen.post_message(CountsReady())

    def on_analysis_ready(self, message: AnalysisReady) -> None:
        if message.error:
            self.notify(f"analysis failed: {message.error}", severity="error")
        for screen in self.screen_stack:
            if isinstance(screen, BrowseScreen):
                screen.post_message(AnalysisReady(message.error))

    def on_kernels_ready(self, message: KernelsReady) -> None:
        for screen in self.screen_stack:
            if isinstance(screen, BrowseScreen):
                screen.post_message(KernelsReady(message.side))

    # -- navigation (screens post these; the top screen is reused when it is of the same kind) --
    def on_open_request(self, message: OpenRequest) -> None:
        self.current_request = message.request_id
        self._show(TokenScreen, lambda top: top.show_request(message.request_id, message.position),
                   lambda: TokenScreen(message.request_id, message.position))

    def on_open_step(self, message: OpenStep) -> None:
        self._show(StepScreen, lambda top: top.show_side(message.side, message.step),
                   lambda: StepScreen(message.side, message.step))

    def on_open_kv(self, message: OpenKv) -> None:
        self.current_request = message.request_id
        self._show(KvScreen, lambda top: top.show_request(message.request_id, message.position),
                   lambda: KvScreen(message.request_id, message.position))

    def _show(self, kind, update, make) -> None:
        """Reuse the top screen where it is of `kind` (update it), else push a new one (make)."""
        if isinstance(self.screen, kind):
            update(self.screen)
        else:
            self.push_screen(make())

    # -- actions --
    def action_overview(self) -> None:
        while len(self.screen_stack) > 1:
            self.pop_screen()

    def action_tokens(self) -> None:
        if self.current_request:
            self.post_message(OpenRequest(self.current_request))

    def action_steps(self) -> None:
        side = B if self.data.two else A
        if isinstance(self.screen, StepScreen):
            self.screen.action_root_cause()
            return
        c = self.data.cause(self.current_request)
        self.post_message(OpenStep(side, (c.b if side == B else c.a).step if c else None))

    def action_kv(self) -> None:
        if not self.current_request:
            return
        position = self.screen.cursor_position if isinstance(self.screen, TokenScreen) else None
        self.post_message(OpenKv(self.current_request, position))

    def action_back(self) -> None:
        if len(self.screen_stack) > 1:
            self.pop_screen()

    def action_help(self) -> None:
        sections = [("everywhere", "keys that work on every screen", self.BINDINGS)]
        for cls in (OverviewScreen, TokenScreen, StepScreen, KvScreen):
            name = {OverviewScreen: "overview", TokenScreen: "tokens", StepScreen: "steps", KvScreen: "KV"}[cls]
            sections.append((name, cls.HELP, cls.BINDINGS))
        sections.append(("tables", "move with the arrows, page up/down, home/end; click a row",
                         [Binding("enter", "", "open / jump (tokens → B's step, step → its token, KV → writer)")]))
        self.push_screen(HelpScreen(sections))

    def _prompt(self, kind: str) -> None:
        screen = self.screen
        if not isinstance(screen, BrowseScreen):
            return
        prompt = screen.GOTO_PROMPT if kind == "goto" else screen.SEARCH_PROMPT
        if not prompt:
            self.notify(f"nothing to {'go to' if kind == 'goto' else 'search'} on this screen", severity="warning")
            return

        def done(value: str | None) -> None:
            if not value:
                return
            err = screen.goto(value) if kind == "goto" else screen.search(value)
            if err:
                self.notify(err, severity="warning")

        self.push_screen(PromptScreen("go to" if kind == "goto" else "search", prompt), done)

    def action_goto(self) -> None:
        self._prompt("goto")

    def action_search(self) -> None:
        self._prompt("search")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def run_browser(path_a, path_b=None) -> int:
    """Open the traces and run the browser. 0 when the user quits; 2 (one line on stderr) on bad input."""
    try:
        data = BrowseData.open(path_a, path_b)
    except DivergenceInputError as e:
        print(f"divergence browse: error: {_one_line(e)}", file=sys.stderr)
        return 2
    try:
        BrowseApp(data).run()
    finally:
        data.close()
    return 0
