"""Atomic file writes: a file is replaced only by a whole new one, or not at all.

The bytes go to a unique temporary name in the target's directory (so two writers
never share one), are fsynced, and the temporary is renamed over the target; any
failure (a full disk: ENOSPC) removes the temporary and leaves the old file as it
was. Stdlib only: callers turn OSError into their own error.
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path

__all__ = ["write_atomic", "temp_name"]


def temp_name(path, tag: str = "tmp") -> Path:
    """A name beside `path` that no other process (nor call) uses: `name.PID-RANDOM.tag`
    (`serial.h5` -> `serial.h5.4242-1a2b3c4d.partial` for tag='partial')."""
    p = Path(path)
    return p.with_name(f"{p.name}.{os.getpid()}-{secrets.token_hex(4)}.{tag}")


def write_atomic(path, data, *, encoding: str = "utf-8", mode: int | None = None) -> Path:
    """Write `data` (str or bytes) to `path` atomically; returns the path.

    The new file gets `mode`, else the old file's permission bits, else 0o666 less the
    umask (what open() would give). OSError on failure, with nothing left behind."""
    p = Path(path)
    raw = data.encode(encoding) if isinstance(data, str) else bytes(data)
    if mode is None:
        try:
            mode = os.stat(p).st_mode & 0o7777
        except OSError:
            mode = None  # a new file: 0o666 less the umask, as os.open gives it
    tmp = temp_name(p)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        view = memoryview(raw)
        while view:
            n = os.write(fd, view)
            if n <= 0:  # pragma: no cover  (a write that writes nothing would loop forever)
                raise OSError(f"short write to {tmp}")
            view = view[n:]
        if mode is not None:
            os.fchmod(fd, mode)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, p)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(p.parent)
    return p


def _fsync_dir(d: Path) -> None:
    """Make the rename durable (best effort: some filesystems refuse a directory fsync)."""
    try:
        fd = os.open(d if str(d) else ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
