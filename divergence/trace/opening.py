"""Opening trace files: one clear TraceError for anything that is not a readable
trace, and one shared h5py.File per file per process."""
from __future__ import annotations

import time
from pathlib import Path

import h5py

from ..errors import TraceError
from . import schema as S


class _OpenFiles:
    """One h5py.File per file per process, shared by every Trace of it. HDF5 shares an
    open file's metadata cache between handles anyway, and an SWMR refresh through one
    handle left another handle's next reads older than its previous ones (measured)."""

    def __init__(self):
        self.files: dict = {}  # (st_dev, st_ino) -> [file, swmr, count]

    def acquire(self, p: Path) -> tuple[h5py.File, bool]:
        st = p.stat()
        key = (st.st_dev, st.st_ino)
        entry = self.files.get(key)
        if entry is None or not entry[0].id.valid:
            f, swmr = _open(p)
            entry = self.files[key] = [f, swmr, 0]
        entry[2] += 1
        return entry[0], entry[1]

    def release(self, f: h5py.File) -> None:
        for key, entry in list(self.files.items()):
            if entry[0] is f:
                entry[2] -= 1
                if entry[2] <= 0:
                    del self.files[key]
                    f.close()
                return
        f.close()


FILES = _OpenFiles()


TRUNCATED_RETRIES = (0.005, 0.02, 0.05)  # seconds between opens of a file that reads truncated


def _open(p: Path) -> tuple[h5py.File, bool]:
    try:
        if not h5py.is_hdf5(p):
            raise TraceError(f"{p} is not an HDF5 file (corrupt or not a trace)")
        for wait in (*TRUNCATED_RETRIES, None):
            try:
                return h5py.File(p, "r"), False
            except OSError as e:
                if "truncated" not in str(e):
                    # a writer killed mid-run (or still running) leaves the file marked open for SWMR writing
                    return h5py.File(p, "r", swmr=True, rdcc_nbytes=0), True
                # a live writer's flush extends the file just after its superblock names the new end:
                # an open in between reads it truncated (rarely, but a reader polling a live trace meets
                # it); one still short after the retries is
                if wait is None:  # (SWMR reads skip the EOF check and can hang on these)
                    raise TraceError(f"{p} is truncated (corrupt or partially copied)") from None
                time.sleep(wait)
    except TraceError:
        raise
    except (OSError, ValueError) as e:
        raise TraceError(f"cannot read {p}: corrupt HDF5 ({' '.join(str(e).split())})") from None  # one line


def check(p: Path, f: h5py.File) -> None:
    fmt = f.attrs.get("format")
    if fmt != S.FORMAT:
        raise TraceError(f"{p} is an HDF5 file but not a divergence trace")
    version = int(f.attrs.get("schema_version", -1))
    if version > S.SCHEMA_VERSION:
        raise TraceError(f"{p} uses trace schema {version}, newer than this divergence reads "
                         f"({S.SCHEMA_VERSION}); upgrade divergence")
    if version < 1:
        raise TraceError(f"{p} has no valid schema_version")
    for name in ("steps", "tokens", S.REQUESTS, S.META, S.STATUS):
        if name not in f:
            raise TraceError(f"{p} is a damaged trace: /{name} is missing")
