"""replay / bisect --confirm progress: a `\\r` step line on a terminal, nothing in a pipe (issue 32)."""
from __future__ import annotations

import io
import sys

from divergence.analysis.replay_progress import REPLAY_PROGRESS
from divergence.cli.progress import StepLine, replay_progress


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_no_terminal_no_progress(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with replay_progress():
        assert REPLAY_PROGRESS.get() is None


def test_on_a_terminal_replays_show_their_step(monkeypatch):
    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)

    class T:
        num_steps = 3

    with replay_progress():
        line = REPLAY_PROGRESS.get()(T())
    assert REPLAY_PROGRESS.get() is None  # put back
    assert isinstance(line, StepLine)
    line.every_s = 0
    for _ in range(3):
        line.on_step(None)
    line.on_run_end(True)
    assert "\rreplaying step 3/3" in tty.getvalue() and tty.getvalue().endswith("\r\x1b[K")
