"""Room kept on a trace's disk for HDF5 to finish with. A full disk must end in one clean
error, but HDF5 crashes (at close, or later at GC) when it cannot write the metadata it
holds. So each writer takes a reserve file beside its trace before it creates it, and the
first write that fails releases every reserve of the process: the failing file can then
flush and close cleanly, and its caller removes it."""
from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

RESERVE_BYTES = 256 << 10  # HDF5's metadata of a trace is a few KiB to a few hundred
MIN_FREE_BYTES = 64 << 10  # below this a trace cannot even be created: refused before HDF5 runs

_held: set[Path] = set()
_lock = threading.Lock()


def take(trace_path) -> Path:
    """Reserve room beside `trace_path` (a hidden file named after it); returns its path.
    OSError(ENOSPC) where the disk has too little room left to write a trace at all."""
    p = Path(trace_path)
    reserve = p.parent / f".{p.name}.{os.getpid()}.reserve"
    st = os.statvfs(p.parent)
    free = st.f_bavail * st.f_frsize
    if free < MIN_FREE_BYTES:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(p.parent))
    size = min(RESERVE_BYTES, free // 4)
    fd = os.open(reserve, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.write(fd, b"\0" * size)  # a filesystem without fallocate: real bytes hold the room
    except OSError:
        os.close(fd)
        reserve.unlink(missing_ok=True)
        raise
    os.close(fd)
    with _lock:
        _held.add(reserve)
    return reserve


def release(reserve: Path | None) -> None:
    """Give one reserve's room back (its writer is done)."""
    if reserve is None:
        return
    with _lock:
        _held.discard(reserve)
    reserve.unlink(missing_ok=True)


def release_all() -> None:
    """A write failed: give every reserve's room to HDF5, so the failing files can close."""
    with _lock:
        held = list(_held)
        _held.clear()
    for r in held:
        r.unlink(missing_ok=True)
