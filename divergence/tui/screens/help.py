"""`?`: every key of every screen, read from their bindings."""
from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

KEY_NAMES = {"question_mark": "?", "escape": "esc", "enter": "enter", "slash": "/"}


def _key(b: Binding) -> str:
    return ", ".join(KEY_NAMES.get(k, k) for k in b.key.split(","))


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,question_mark,q", "dismiss", "close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 90; max-width: 100%; height: auto; max-height: 90%;
                                  border: thick $primary; background: $surface; padding: 0 1; }
    """

    def __init__(self, sections: list[tuple[str, str, list]]):
        """sections: (title, one-line description, bindings)."""
        super().__init__()
        self.sections = sections

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(self._render_help(), id="help-text")

    def _render_help(self):
        t = Table(box=None, show_header=False, padding=(0, 1), expand=True)
        t.add_column(width=14, style="bold cyan", no_wrap=True)
        t.add_column(ratio=1)
        for title, desc, bindings in self.sections:
            t.add_row(Text(title, style="bold underline"), Text(desc, style="italic"))
            for b in bindings:
                if b.description:
                    t.add_row(_key(b), b.description)
            t.add_row("", "")
        t.add_row("", Text("esc / ? closes this help", style="dim"))
        return t

    def action_dismiss(self) -> None:
        self.dismiss(None)
