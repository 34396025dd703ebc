"""How the `divergence` command ends.

Once main() has returned, what the process owes anyone is done: traces are renamed into
place and the report is written. So the command leaves with os._exit and skips the
interpreter's teardown:
- freeing a model's arrays and modules one by one, a visible share of a short run's wall time
  for a large model;
- OpenBLAS 0.3.21's exit handler, which can deadlock joining its worker threads (mlx-lm's
  BatchGenerator script hung so in 1 run of 5 in fp32: bench/bench_process.py).

Before leaving it does what a normal exit does that matters: it joins the threads that are not
daemons, runs the atexit handlers (the backend stores' last writes), and flushes stdout and
stderr. Under a tracer or a profiler (coverage, pyinstrument), which write their results at
teardown, it exits normally.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading


def leave(code: int) -> None:
    """End the process with exit status `code` (never returns)."""
    if sys.gettrace() is not None or sys.getprofile() is not None:
        sys.exit(code)
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that left (BrokenPipe), a closed stream
            code = code or 1
    os._exit(code)
