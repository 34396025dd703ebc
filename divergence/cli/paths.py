"""Where a command's output may go, checked once before any work starts.

An output path must exist or be creatable (its nearest existing ancestor a
directory, not a regular file), sit in a writable directory, be a file where a
file is meant (not a directory, FIFO or device) and a directory where a directory
is meant, and be none of the command's inputs (same resolved path, or the same
st_dev/st_ino: a hard link or a symlink to the input counts).

An existing file there is replaced only by output of its own kind (REPLACES):
- an HTML page (`--html`) replaces an HTML page;
- a trace (`--out`) replaces only the same command's own earlier output at that path,
  unchanged since it was written (own_outputs.py keeps the list): never a trace the
  command did not write there, whatever its name or extension;
- an empty file may be replaced by anything (nothing is lost).
Any other existing file is refused. A refusal is one DivergenceInputError line; nothing
is created or changed. Commands that write traces call remember_outputs() once they are
written, so that their next run may replace them.
"""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from ..errors import DivergenceInputError
from . import own_outputs

__all__ = ["check_output_file", "check_output_dir", "remember_outputs", "same_file", "file_kind", "TRACE", "HTML"]

TRACE, HTML = "trace", "html"  # kinds of output
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def check_output_file(path, *, flag: str, inputs=(), kind: str = TRACE, command: str | None = None) -> Path:
    """`path` as the file a command will write (atomically: a temporary beside it, renamed).

    The one guard of every output file: `kind` is what the command writes there (TRACE or
    HTML), `command` the command's name, which may replace its own earlier trace
    (remember_outputs); without it no existing trace is replaced."""
    p = Path(path)
    what = f"{flag} {p}"
    st = _stat(p, what)
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise DivergenceInputError(f"{what} is a directory; name a file in it, e.g. {p / _example(flag)}")
        if not stat.S_ISREG(st.st_mode):
            raise DivergenceInputError(f"{what} is not a regular file (a FIFO, socket or device); name a file")
        _not_an_input(p, what, inputs)
        _may_replace(p, st, what, kind=kind, command=command)
    _writable_dir(p.parent, what)
    return p


def remember_outputs(paths, *, command: str) -> None:
    """Note traces `command` has just written: its next run may replace them (and only them)."""
    own_outputs.remember([p for p in paths if p is not None], command=command)


def file_kind(path) -> str | None:
    """TRACE (an HDF5 file, by its signature, whatever its extension), HTML (an HTML page),
    None for anything else or unreadable."""
    try:
        with open(path, "rb") as f:
            head = f.read(1024)
            size = os.fstat(f.fileno()).st_size
            off = 512  # HDF5's superblock: at 0, or after a user block of 512 * 2**n bytes
            found = head.startswith(HDF5_SIGNATURE)
            while not found and off + len(HDF5_SIGNATURE) <= size:
                f.seek(off)
                found = f.read(len(HDF5_SIGNATURE)) == HDF5_SIGNATURE
                off *= 2
    except OSError:
        return None
    if found:
        return TRACE
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if text.startswith((b"<!doctype html", b"<html")):
        return HTML
    return None


REPLACES = {HTML: (HTML,), TRACE: ()}  # kind written -> kinds of file it may replace
_NAMES = {TRACE: "a trace", HTML: "an HTML page", None: "a file of another kind"}


def _may_replace(p: Path, st, what: str, *, kind: str, command: str | None) -> None:
    """Refuse `p` unless it is empty, of a kind that `kind` replaces, or `command`'s own earlier output."""
    if st.st_size == 0:
        return  # nothing to lose
    if command is not None and own_outputs.wrote(p, command=command, st=st):
        return  # this command's own earlier output, unchanged since
    found = file_kind(p)
    if found in REPLACES[kind]:
        return
    own = f" ({command} replaces only its own earlier output, unchanged since)" if kind == TRACE and command else ""
    if found == TRACE:
        mine = " this command did not write there" if kind == TRACE else ""
        raise DivergenceInputError(f"{what} is an existing trace{mine}; divergence never writes over a trace{own}: "
                                   f"move it or name another file")
    mine = " this command wrote" if kind == TRACE else ""
    raise DivergenceInputError(f"{what} exists and is {_NAMES[found]}, not {_NAMES[kind]}{mine}; writing would "
                               f"destroy it{own}: move it or name another file")


def check_output_dir(path, *, flag: str = "--out", files=(), inputs=(), kind: str = TRACE,
                     command: str | None = None) -> Path:
    """`path` as a directory a command creates (if needed) and writes `files` into (each of `kind`:
    an existing one is replaced as check_output_file says)."""
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
        _may_replace(f, fst, f"{flag} {p}: {f}", kind=kind, command=command)
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
