"""Which files a command wrote as its output, so that its next run may replace them (and nothing else).

A command that writes a trace replaces an existing file only when it is that command's own
earlier output at that path, unchanged since: the same device, inode, size and modification
time as when it was written. A trace copied into its place, another command's output, or an
edit after it was written all break the match, and the command refuses (cli/paths.py).

The list lives in the user cache directory (DIVERGENCE_CACHE_DIR, else ~/.cache/divergence)
as outputs.json: path -> [command, st_dev, st_ino, st_size, st_mtime_ns]. Best effort: where
it cannot be read or written, no file counts as a command's own, and the refusal names the file.
Stdlib only (the parser imports every command).
"""
from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from ..core.atomic import write_atomic

CACHE_ENV = "DIVERGENCE_CACHE_DIR"  # the cache directory the rest of divergence uses (engine, probe)
LEDGER = "outputs.json"
MAX_ENTRIES = 4096  # the oldest are forgotten first: their files then count as another's

__all__ = ["remember", "wrote"]


def ledger_path() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "divergence") / LEDGER


def _key(path) -> str:
    return os.path.abspath(os.path.realpath(path))


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def wrote(path, *, command: str, st: os.stat_result | None = None) -> bool:
    """Whether `command` wrote `path` (its last output there) and nothing changed it since."""
    try:
        st = st or os.stat(path)
        entry = _read().get(_key(path))
    except (OSError, ValueError):
        return False
    return isinstance(entry, list) and entry == [command, *_identity(st)]


def remember(paths, *, command: str) -> bool:
    """Note `paths` (just written by `command`) as its own. False where the list cannot be written."""
    try:
        d = ledger_path().parent
        d.mkdir(parents=True, exist_ok=True)
        with open(d / (LEDGER + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # read-modify-write: one process at a time
            entries = {k: v for k, v in _read().items() if _still(k, v)}
            for p in paths:
                entries.pop(_key(p), None)  # re-inserted last: the newest are kept longest
                entries[_key(p)] = [command, *_identity(os.stat(p))]
            keep = dict(list(entries.items())[-MAX_ENTRIES:])
            write_atomic(ledger_path(), json.dumps(keep, separators=(",", ":")))
    except (OSError, ValueError):
        return False
    return True


def _read() -> dict:
    try:
        data = json.loads(ledger_path().read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return {}  # unreadable or damaged: nothing counts as a command's own (rewritten by the next remember)
    return data if isinstance(data, dict) else {}


def _still(path: str, entry) -> bool:
    """An entry whose file is still as it was written (the rest are dropped)."""
    try:
        return isinstance(entry, list) and entry[1:] == _identity(os.stat(path))
    except OSError:
        return False
