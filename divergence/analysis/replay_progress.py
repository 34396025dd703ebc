"""A front end's progress display of replays: (trace) -> engine Observer, set for the length
of one command (cli/progress.py); every replay (replayer.py) then reports its steps to it.
None: no display. Engine-free, so setting it loads no BLAS."""
from __future__ import annotations

import contextvars

REPLAY_PROGRESS: contextvars.ContextVar = contextvars.ContextVar("divergence_replay_progress", default=None)
