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


def test_a_replay_line_names_the_request_it_confirms(monkeypatch):
    from divergence.analysis.replay_progress import replay_label

    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)

    class T:
        num_steps = 5

    with replay_progress(), replay_label("confirming r3 (2/7):"):
        line = REPLAY_PROGRESS.get()(T())
    line.every_s = 0
    line.on_step(None)
    assert "\rconfirming r3 (2/7): replaying step 1/5" in tty.getvalue()


def test_a_rerun_shows_its_steps_and_tokens_on_a_terminal_only(monkeypatch):
    from divergence.cli.progress import RunLine, rerun_progress

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with rerun_progress("live.h5", ["a"]) as observers:
        assert observers == []
    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    with rerun_progress("live.h5", ["a", "b"]) as observers:
        [line] = observers
        assert isinstance(line, RunLine)
        line.every_s = 0
        line.on_token(None)
        line.on_token(None)
        line.on_step(None)
    assert "\rre-running 2 requests serially: step 1, 2 tokens" in tty.getvalue()
    assert tty.getvalue().endswith("\r\x1b[K")  # the line is cleared for what follows
