"""The server's traces hold its users' prompts: they, and their re-runs, are their owner's only.

A trace is created with TRACE_MODE from its first byte (TraceWriter's `mode`), never
chmod-ed after: no moment where the umask's bits let another user open it. A directory the
server creates gets DIR_MODE; one that exists keeps its mode (a user's choice, never
loosened nor tightened). A file another library writes (mlx-lm's re-run, through the
Recorder) is made inside a DIR_MODE directory of its own and given TRACE_MODE there, before
it is renamed into place.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

TRACE_MODE = 0o600
DIR_MODE = 0o700


def make_dir(path) -> Path:
    """`path` as a directory: created (with its missing parents) DIR_MODE, or as it is."""
    p = Path(path)
    for d in reversed([p, *p.parents]):
        if not d.exists():
            d.mkdir(mode=DIR_MODE, exist_ok=True)
    return p


@contextmanager
def private_place(path):
    """A temporary name for the file `path`, in a DIR_MODE directory beside it, removed at
    the end; `publish(tmp)` gives the file TRACE_MODE and renames it to `path`."""
    p = Path(path)
    d = Path(tempfile.mkdtemp(prefix=f".{p.name}.", dir=p.parent))  # (mkdtemp: 0o700)
    try:
        yield d / p.name
    finally:
        shutil.rmtree(d, ignore_errors=True)


def publish(tmp, path) -> Path:
    """The finished file `tmp` (in a private_place) to `path`, TRACE_MODE."""
    os.chmod(tmp, TRACE_MODE)
    os.replace(tmp, path)
    return Path(path)
