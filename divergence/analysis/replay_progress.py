"""A front end's progress display of replays: (trace) -> engine Observer, set for the length
of one command (cli/progress.py); every replay (replayer.py) then reports its steps to it.
None: no display. REPLAY_LABEL: what the replays are for (bisect sets it per request it
confirms), shown before the step count. Engine-free, so setting it loads no BLAS."""
from __future__ import annotations

import contextlib
import contextvars

REPLAY_PROGRESS: contextvars.ContextVar = contextvars.ContextVar("divergence_replay_progress", default=None)
REPLAY_LABEL: contextvars.ContextVar = contextvars.ContextVar("divergence_replay_label", default="")


@contextlib.contextmanager
def replay_label(text: str):
    """Replays inside are `text`'s (e.g. 'confirming r3 (2/7)')."""
    token = REPLAY_LABEL.set(text)
    try:
        yield
    finally:
        REPLAY_LABEL.reset(token)
