"""Checks of what a trace says about its run, before a reader trusts it: the file's attributes
(code tables, widths, top_k, the KV hash, the commit table names), /meta's JSON, /status, the
commit record, /requests and /vocab.

Each reader of these (header.py, reader.py) calls the check of what it reads, once per
snapshot; a damaged value is one TraceError naming it ("PATH is a damaged trace: attrs['kinds']
..."), so diff, bisect, replay, report, browse and the plugin say so on one line instead of
crashing or decoding tokens as the wrong text. What can be checked is checked: an edit that
keeps every value well formed (a token's text changed within its bytes) is not detectable.
"""
from __future__ import annotations

import json
from dataclasses import fields

import numpy as np
import xxhash

from ..core.settings import EngineSettings
from . import schema as S
from .validate import damaged

# attributes that readers take as text (labels, the hash's name)
TEXT_ATTRS = ("schedule", "policy", "created", "kv_hash")
META_OBJECTS = {"settings": False, "model": False, "draft": True, "environment": False}  # name -> may be null
DIGEST = "xxh3_64"  # /vocab's attribute: the hash of its offsets and bytes (traces written since issue 49)


def attrs(path, a: dict) -> None:
    """The file's attributes that readers use: code tables, widths, top_k, kv_hashes, labels."""
    for key, base in S.CODE_TABLES.items():
        if key in a:
            code_table(path, key, a[key], base)
    if "top_k" in a and not _int(a["top_k"], low=1):
        raise damaged(path, f"attrs['top_k'] is {_show(a['top_k'])}, not a count of logits >= 1")
    if "widths" in a:
        try:
            w = json.loads(a["widths"])
        except (TypeError, ValueError):
            w = None
        if not isinstance(w, dict) or not all(_int(v, low=1) for v in w.values()):
            raise damaged(path, "attrs['widths'] is not a JSON object of widths >= 1")
        if "top_k" in a and w.get("top_k", a["top_k"]) != a["top_k"]:
            raise damaged(path, f"attrs['top_k'] is {_show(a['top_k'])}, attrs['widths'] says {w['top_k']}")
    if "kv_hashes" in a and not (isinstance(a["kv_hashes"], (bool, np.bool_)) or _int(a["kv_hashes"], 0, 1)):
        raise damaged(path, f"attrs['kv_hashes'] is {_show(a['kv_hashes'])}, not true or false")
    for key in TEXT_ATTRS:
        if key in a and not isinstance(a[key], (str, bytes)):
            raise damaged(path, f"attrs['{key}'] is {_show(a[key])}, not text")
    if "commit_tables" in a:
        names = code_table(path, "commit_tables", a["commit_tables"], ())
        unknown = [n for n in names if n not in S.TABLES]
        if unknown:
            raise damaged(path, f"attrs['commit_tables'] names {unknown[0]!r}, no table of the schema")


def code_table(path, key: str, v, base: tuple) -> tuple[str, ...]:
    """A code table as stored: 1-D text, no name twice, the schema's own names first, in order
    (a writer appends an engine's own names after them; older files hold fewer)."""
    if not isinstance(v, np.ndarray) or v.ndim != 1 or not all(isinstance(x, (str, bytes)) for x in v):
        raise damaged(path, f"attrs['{key}'] is not a list of names")
    names = tuple(x.decode() if isinstance(x, bytes) else str(x) for x in v)
    if len(set(names)) != len(names):
        raise damaged(path, f"attrs['{key}'] names one entry twice")
    n = min(len(names), len(base))
    if names[:n] != tuple(base[:n]):
        i = next(i for i in range(n) if names[i] != base[i])
        raise damaged(path, f"attrs['{key}'] entry {i} is {names[i]!r}, where the schema has {base[i]!r}")
    return names


def meta(path, m: dict) -> None:
    """/meta's JSON attributes (already parsed): objects where readers take objects, and the
    engine settings a replay runs under of the types it takes (values as recorded: mlx-lm's
    engine records block_size 0)."""
    for k, nullable in META_OBJECTS.items():
        if not (isinstance(m[k], dict) or nullable and m[k] is None):
            raise damaged(path, f"/meta attribute {k!r} is not a JSON object")
    s = m["settings"]
    for f in fields(EngineSettings):
        if f.name in s and s[f.name] is not None and not _same_type(s[f.name], f.default):
            raise damaged(path, f"/meta settings {f.name!r} is {s[f.name]!r}, not {_TYPE_NAMES[type(f.default)]}")
    if isinstance(s.get("spec_k"), int) and s["spec_k"] < 0:  # (others' engines record 0 for what they lack)
        raise damaged(path, f"/meta settings 'spec_k' is {s['spec_k']}, not >= 0")
    tp = s.get("tp")
    if tp is not None and not (isinstance(tp, dict) and _int(tp.get("degree", 1), low=1)):
        raise damaged(path, "/meta settings 'tp' is not an object with a degree >= 1")


def status(path, f) -> bool:
    """/status: one flag, 0 (running or killed) or 1 (completed)."""
    try:
        v = f[S.STATUS][()]
    except Exception as e:  # noqa: BLE001  (HDF5: a damaged dataset)
        raise damaged(path, f"/status cannot be read ({e})") from None
    if getattr(v, "ndim", 0) != 1 or len(v) < 1 or v.dtype.kind not in "iub" or int(v[0]) not in (0, 1):
        raise damaged(path, "/status is not one flag 0 or 1")
    return bool(v[0])


def commit(path, c, names) -> None:
    """The commit record as stored: int64 [1 + tables, 3], (sequence, 0, 0) then per table
    (body rows, tail rows, tail slot 0 or 1), every count >= 0."""
    if getattr(c, "dtype", None) is None or c.dtype.kind not in "iu" or c.shape != (1 + len(names), 3):
        raise damaged(path, f"/commit is {getattr(c, 'dtype', '?')} {getattr(c, 'shape', '?')}, not integers "
                            f"[{1 + len(names)}, 3] for attrs['commit_tables']")
    rows = c[1:]
    bad = (rows[:, 0] < 0) | (rows[:, 1] < 0) | ~np.isin(rows[:, 2], (0, 1))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise damaged(path, f"/commit row for /{names[i]} is {rows[i].tolist()}: not (rows >= 0, rows >= 0, slot 0|1)")


def requests(path, ids, off, flat, arr, mt, temp, top_p) -> None:
    """/requests' columns (lengths and dtypes checked): text ids, prompt token ids >= 0, and
    the arrival, max_tokens and sampling a replay runs them with."""
    if ids.dtype.kind not in "OSU" or not all(isinstance(x, (str, bytes)) for x in ids):
        raise damaged(path, "/requests/id is not text")
    for name, a, bad in (("prompt_tokens", flat, flat < 0), ("arrival", arr, arr < 0), ("max_tokens", mt, mt < 0),
                         ("temperature", temp, ~(np.isfinite(temp) & (temp >= 0))),
                         ("top_p", top_p, ~((top_p > 0) & (top_p <= 1)))):
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise damaged(path, f"/requests/{name} entry {i} is {a[i]}, out of range")
    if len(off) and off[0] != 0:
        raise damaged(path, f"/requests/prompt_offsets start at {int(off[0])}, not 0")


def request_ids(path, ids: list[str]) -> None:
    """No id twice (in /requests and /live_requests together): readers find a request by its id."""
    if len(set(ids)) != len(ids):
        seen = set()
        dup = next(i for i in ids if i in seen or seen.add(i))
        raise damaged(path, f"request id {dup!r} is in the trace twice")


def vocab_digest(raw: np.ndarray, offsets: np.ndarray) -> str:
    """xxh3_64 of /vocab: its offsets (int64, little-endian), then its bytes."""
    h = xxhash.xxh3_64(np.asarray(offsets, "<i8").tobytes())
    h.update(np.asarray(raw, np.uint8).tobytes())
    return h.hexdigest()


def vocab(path, raw, off, digest=None) -> None:
    """/vocab: token i's text is bytes[offsets[i]:offsets[i + 1]], utf-8 (surrogates passed),
    each token decoded alone: offsets from 0 to the end of the bytes, never decreasing, none
    in the middle of a character; and where the file holds their digest, the one they have."""
    if getattr(raw, "ndim", 0) != 1 or raw.dtype.kind not in "iu" or raw.dtype.itemsize != 1:
        raise damaged(path, f"/vocab/bytes is {getattr(raw, 'dtype', '?')} {getattr(raw, 'shape', '')}, not 1-D bytes")
    if getattr(off, "ndim", 0) != 1 or off.dtype.kind not in "iu" or len(off) < 1:
        raise damaged(path, f"/vocab/offsets is {getattr(off, 'dtype', '?')} {getattr(off, 'shape', '')}, "
                            f"not a 1-D array of integers")
    if int(off[0]) != 0 or int(off[-1]) != len(raw):
        raise damaged(path, f"/vocab/offsets run from {int(off[0])} to {int(off[-1])}, not from 0 to the "
                            f"{len(raw)} bytes of /vocab/bytes")
    back = np.diff(off.astype(np.int64)) < 0
    if back.any():
        i = int(np.flatnonzero(back)[0])
        raise damaged(path, f"/vocab/offsets entry {i + 1} ({int(off[i + 1])}) is before entry {i} ({int(off[i])})")
    data = raw.astype(np.uint8, copy=False)
    try:
        data.tobytes().decode("utf-8", "surrogatepass")
    except UnicodeDecodeError as e:
        raise damaged(path, f"/vocab/bytes is not utf-8 (byte {e.start})") from None
    starts = off[:-1][off[:-1] < len(data)].astype(np.int64)
    mid = (data[starts] & 0xC0) == 0x80  # a continuation byte: the offset splits a character
    if mid.any():
        i = int(np.flatnonzero(off[:-1] < len(data))[np.flatnonzero(mid)[0]])
        raise damaged(path, f"/vocab/offsets entry {i} ({int(off[i])}) splits a character")
    if digest is not None and (digest.decode() if isinstance(digest, bytes) else str(digest)) != vocab_digest(data, off):
        raise damaged(path, f"/vocab's offsets and bytes are not those it was written with (their {DIGEST} differs)")


_TYPE_NAMES = {bool: "true or false", int: "an integer", str: "text", type(None): "text"}


def _show(v) -> str:
    return repr(v.item() if isinstance(v, np.generic) else v)


def _int(v, low: int | None = None, high: int | None = None) -> bool:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        return False
    return (low is None or v >= low) and (high is None or v <= high)


def _same_type(v, default) -> bool:
    """A JSON value of the type of a settings field's default (bool is not an int)."""
    if isinstance(default, bool):
        return isinstance(v, bool)
    if isinstance(default, int):
        return isinstance(v, int) and not isinstance(v, bool)
    if isinstance(default, str) or default is None:
        return isinstance(v, str)
    return True
