"""Progress lines for long commands: on a terminal only (a pipe or a log gets no `\\r` and no
blank lines), cheap (one short write every few steps)."""
from __future__ import annotations

import contextlib
import sys
import time

from ..core.events import Observer


def on_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stderr
        return False


class StepLine(Observer):
    """An engine observer that keeps one `\\r` line: 'replaying step 120/433'."""

    def __init__(self, what: str, total, *, every_s: float = 0.1):
        self.what, self.total, self.every_s = what, total, every_s
        self.done = 0
        self._last = 0.0
        self._shown = False

    def text(self) -> str:
        return f"{self.what} step {self.done}/{self.total}"

    def on_step(self, event) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            self._shown = True
            sys.stderr.write(f"\r{self.text()}")
            sys.stderr.flush()

    def on_run_end(self, completed: bool) -> None:
        if self._shown:  # leave the line empty for what follows
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
            self._shown = False


class RunLine(StepLine):
    """A StepLine for a run whose length is not known ahead (a re-run): 're-running serially:
    step 120, 340 tokens'."""

    def __init__(self, what: str, *, every_s: float = 0.1):
        super().__init__(what, None, every_s=every_s)
        self.tokens = 0

    def on_token(self, event) -> None:
        self.tokens += 1

    def text(self) -> str:
        return f"{self.what}: step {self.done}, {self.tokens} tokens"


@contextlib.contextmanager
def rerun_progress(live, ids=None):
    """The observers a re-run adds: a RunLine on a terminal, none elsewhere."""
    if not on_tty():
        yield []
        return
    what = f"re-running {len(ids)} requests serially" if ids else "re-running serially"
    line = RunLine(what)
    try:
        yield [line]
    finally:
        line.on_run_end(False)


@contextlib.contextmanager
def replay_progress(what: str = "replaying"):
    """While inside, every replay (divergence.analysis.replayer.Replayer) shows a StepLine on a
    terminal (through analysis.replay_progress.REPLAY_PROGRESS); elsewhere nothing changes."""
    if not on_tty():
        yield
        return
    from ..analysis.replay_progress import REPLAY_LABEL, REPLAY_PROGRESS  # (lazy: the parser imports every command)

    def line(trace):
        try:
            total = trace.num_steps
        except Exception:  # a progress line is never worth a failure
            total = "?"
        label = REPLAY_LABEL.get()
        return StepLine(f"{label} {what}" if label else what, total)

    token = REPLAY_PROGRESS.set(line)
    try:
        yield
    finally:
        REPLAY_PROGRESS.reset(token)
