"""Where a command's output may go, checked once before any work starts.

An output path must exist or be creatable (its nearest existing ancestor a
directory, not a regular file), sit in a writable directory, be a file where a
file is meant (not a directory, FIFO or device) and a directory where a directory
is meant, and be none of the command's inputs (same resolved path, or the same
st_dev/st_ino: a hard link or a symlink to the input counts). A refusal is one
DivergenceInputError line; nothing is created or changed.
"""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from ..errors import DivergenceInputError

__all__ = ["check_output_file", "check_output_dir", "same_file"]


def check_output_file(path, *, flag: str, inputs=()) -> Path:
    """`path` as the file a command will write (atomically: a temporary beside it, renamed)."""
    p = Path(path)
    what = f"{flag} {p}"
    st = _stat(p, what)
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise DivergenceInputError(f"{what} is a directory; name a file in it, e.g. {p / _example(flag)}")
        if not stat.S_ISREG(st.st_mode):
            raise DivergenceInputError(f"{what} is not a regular file (a FIFO, socket or device); name a file")
        _not_an_input(p, what, inputs)
    _writable_dir(p.parent, what)
    return p


def check_output_dir(path, *, flag: str = "--out", files=(), inputs=()) -> Path:
    """`path` as a directory a command creates (if needed) and writes `files` into."""
    p = Path(path)
    what = f"{flag} {p}"
    st = _stat(p, what)
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise DivergenceInputError(f"{what} exists and is not a directory")
    for name in files:
        f = p / name
        fst = _stat(f, f"{flag} {f}") if st is not None else None
        if fst is None:
            continue
        if stat.S_ISDIR(fst.st_mode):
            raise DivergenceInputError(f"{flag} {p}: {f} is a directory, where the {name} file goes; "
                                       f"move it away or name another --out")
        if not stat.S_ISREG(fst.st_mode):
            raise DivergenceInputError(f"{flag} {p}: {f} is not a regular file (a FIFO, socket or device)")
        _not_an_input(f, f"{flag} {p}: {f}", inputs)
    _writable_dir(p if st is not None else p.parent, what)
    return p


def same_file(a, b) -> bool:
    """Whether paths a and b name one file: equal resolved paths, or one st_dev/st_ino."""
    try:
        if Path(a).resolve() == Path(b).resolve():
            return True
    except (OSError, RuntimeError):  # a symlink loop
        pass
    try:
        sa, sb = os.stat(a), os.stat(b)
    except (OSError, ValueError):
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _not_an_input(p: Path, what: str, inputs) -> None:
    for i in inputs:
        if i is not None and same_file(p, i):
            raise DivergenceInputError(f"{what} is one of the command's inputs ({i}); writing it would destroy "
                                       f"the input: name another file")


def _stat(p: Path, what: str):
    """os.stat of p, None when it does not exist; refused when it is under a regular file."""
    try:
        return os.stat(p)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        raise DivergenceInputError(f"{what}: {_file_above(p)} is a regular file, not a directory") from None
    except ValueError:  # an embedded NUL
        raise DivergenceInputError(f"{what}: not a valid path") from None
    except OSError as e:
        raise DivergenceInputError(f"{what}: {e.strerror or e}") from None


def _file_above(p: Path) -> Path:
    for a in p.parents:
        if a.exists():
            return a
    return p.parent  # pragma: no cover


def _writable_dir(d: Path, what: str) -> None:
    """The nearest existing ancestor of d (d itself when it exists) is a directory we may write."""
    d = Path(d) if str(d) else Path(".")
    cur = d
    while True:
        try:
            st = os.stat(cur)
            break
        except FileNotFoundError:
            if cur.parent == cur:
                raise DivergenceInputError(f"{what}: no existing directory above it") from None
            cur = cur.parent
        except NotADirectoryError:
            raise DivergenceInputError(f"{what}: {_file_above(cur)} is a regular file, not a directory") from None
        except OSError as e:
            raise DivergenceInputError(f"{what}: {cur}: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise DivergenceInputError(f"{what}: {cur} is a regular file, not a directory")
    if not os.access(cur, os.W_OK | os.X_OK):
        raise DivergenceInputError(f"{what}: the directory {cur} is not writable")
    try:  # the real test (root passes os.access; a read-only mount does not)
        fd, probe = tempfile.mkstemp(prefix=".divergence-probe-", dir=cur)
    except OSError as e:
        raise DivergenceInputError(f"{what}: cannot write in {cur} ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(probe)


def _example(flag: str) -> str:
    return "report.html" if flag == "--html" else "out.h5"
