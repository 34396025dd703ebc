"""What a trace writer does when a write fails (a full disk): one short reason, and a file
HDF5 cannot flush kept open instead of closed (closing it would crash)."""
from __future__ import annotations

import os
import re

from h5py import h5f, h5i

from . import reserve

_ABANDONED: list = []  # ids of files whose writes failed, kept open (and referenced) until the process ends


def flushes(f) -> bool:
    """Whether f's unwritten data now reaches the disk (with the reserves' room given back to
    HDF5, trace/reserve.py): then it closes cleanly."""
    reserve.release_all()
    try:
        f.flush()
        return True
    except Exception:  # noqa: BLE001
        return False


def close_or_abandon(f) -> None:
    """Close f if its data can still reach the disk, else abandon it (see abandon); never raises."""
    if flushes(f):
        try:
            f.close()
        except Exception:  # noqa: BLE001
            pass
    else:
        abandon(f)


def abandon(f) -> None:
    """Never close a file HDF5 cannot flush. h5py's close of it fails half way, and then the
    datasets' deallocation (at GC or exit) segfaults in HDF5. One more reference on each of its
    open ids keeps HDF5 from ever freeing them; the process exits cleanly, and the caller
    removes the file (its disk space returns when the process ends)."""
    try:
        ids = h5f.get_obj_ids(f.id, h5f.OBJ_ALL)
        for i in ids:
            h5i.inc_ref(i)
        _ABANDONED.append((f, ids))
    except Exception:  # noqa: BLE001  (nothing safer is left to do)
        _ABANDONED.append((f, None))


def reason(e: BaseException) -> str:
    """An I/O failure in a few words, on one line (h5py's messages span lines and name its buffers)."""
    raw = e.strerror if isinstance(e, OSError) and e.strerror else str(e)  # (h5py's strerror spans lines too)
    text = " ".join(str(raw).split())
    m = re.search(r"errno = (\d+)", text)
    if m:
        try:
            return os.strerror(int(m.group(1)))
        except ValueError:
            pass
    m = re.search(r"error message = '([^']+)'", text)
    if m:
        return m.group(1)
    return text[:200] or type(e).__name__
