"""Small helpers for driving the browser in tests."""
from __future__ import annotations

from rich.console import Console


async def settle(pilot) -> None:
    """Let workers (analysis, kernel table, KV grid) finish and their messages land."""
    await pilot.pause()
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()


def text_of(static, width: int = 200) -> str:
    """What a Static shows, as plain text."""
    console = Console(width=width, record=True, color_system=None, file=open("/dev/null", "w"))
    console.print(static.content)
    return console.export_text()


def screen_text(app) -> str:
    """The whole terminal as plain text (one line per row)."""
    strips = app.screen._compositor.render_strips()
    return "\n".join("".join(seg.text for seg in s) for s in strips)
