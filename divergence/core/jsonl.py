"""The one JSON Lines reader: prompt files (workloads/prompts.py) and imported records
(record/jsonl.py) are read through it, strictly and bounded: a regular file (not a FIFO
or a device) of at most a size cap, UTF-8 (a byte-order mark at the start is skipped),
each line one JSON value with no NaN/Infinity and no repeated keys, however deep or
long. Every refusal is the caller's error type with one line naming file:line."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

MAX_FILE_BYTES = 256 << 20  # a larger file is refused, not read into memory


class _BadConstant(ValueError):
    pass


def _no_constant(name):
    raise _BadConstant(f"{name} is not a number JSON allows")


def _no_duplicates(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise _BadConstant(f"the key {k!r} appears twice")
        d[k] = v
    return d


def parse_line(line: str, where: str, error: type[Exception]):
    """One JSON value, strictly; error(f"{where}: ...") for anything json refuses."""
    try:
        return json.loads(line, parse_constant=_no_constant, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        raise error(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    except _BadConstant as e:
        raise error(f"{where}: not valid JSON ({e})") from None
    except RecursionError:
        raise error(f"{where}: not valid JSON (nested too deeply)") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise error(f"{where}: not valid JSON ({' '.join(str(e).split())[:120]})") from None


def read_text(path, error: type[Exception], what: str, cap: int = MAX_FILE_BYTES) -> str:
    """The UTF-8 text of a regular file of at most `cap` bytes; what: "prompt file", ..."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise error(f"{what} not found: {p}") from None
    except (OSError, ValueError) as e:
        raise error(f"cannot read {what} {p}: {getattr(e, 'strerror', None) or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise error(f"{what} is a directory: {p}")
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{what} {p} is not a regular file (a FIFO, socket or device): give a .jsonl file")
    if st.st_size > cap:
        raise error(f"{what} {p} is {st.st_size} bytes; a {what} may hold at most {cap} bytes")
    try:
        with open(p, "rb") as fh:
            raw = fh.read(cap + 1)
    except OSError as e:
        raise error(f"cannot read {what} {p}: {e.strerror or e}") from None
    if len(raw) > cap:  # it grew since the stat
        raise error(f"{what} {p} is larger than {cap} bytes, the most a {what} may hold")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise error(f"{p}:{line}: not UTF-8 text ({e.reason})") from None


def read_lines(path, error: type[Exception], what: str, cap: int = MAX_FILE_BYTES):
    """(line number, file:line, value) for each non-blank line of a JSON Lines file."""
    text = read_text(path, error, what, cap)
    for n, line in enumerate(text.split("\n"), 1):  # not splitlines(): U+2028 may sit inside a JSON string
        if line.strip():
            where = f"{path}:{n}"
            yield n, where, parse_line(line, where, error)
