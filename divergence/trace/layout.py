"""The schema-2 file: every table created at run start, committed a flush at a time.

A table is a compressed compound dataset (its body; /kv_hashes' uncompressed) plus two uncompressed tail
slots: appending a few records to a compressed chunk would rewrite the chunk
elsewhere in the file at every flush (the file then grows by every rewritten chunk),
so the body only ever gets whole chunks, each compressed once, and the rows after
the last whole chunk go to a tail slot, written in place. /commit names, per table,
the body rows, the tail rows and the slot, and is written last; closing moves the
tails into the bodies, so a completed trace is plain compressed tables.
"""
from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

import h5py
import numpy as np

from ..core.atomic import temp_name
from . import schema as S
from .failure import close_or_abandon
from .validate_header import DIGEST, vocab_digest


def _json(obj) -> str:
    return json.dumps(obj, default=str, sort_keys=True)


class TableFile:
    """One table: a compressed body written a whole chunk at a time (each chunk compressed
    once, never rewritten) and the rows after it in one of two uncompressed tail slots,
    overwritten in place; the commit record says which slot holds how many.

    Its datasets are opened at their first write (a run writes a third of the tables, and a
    short one no tail slot, and an HDF5 open is not free). `extend` may run between commits
    (the flush thread, while the engine computes): the body grows past what the last commit
    names, which readers never read, and the committed slot is left as it is until
    `write_tail` fills the other one."""

    def __init__(self, fid, tails_id, name: bytes, rows: int, dtype: np.dtype):
        """rows, dtype: the body's chunk rows and record dtype, as create() made it (reading
        them back from h5py is an HDF5 call each, on the engine's time at run start)."""
        self._where = (fid, tails_id, name)
        self.body = self.tail_ds = None
        self.rows = rows
        self.nb = 0  # rows in the body
        self.tail = np.empty(0, dtype)  # rows after it (fewer than one chunk)
        self.slot = 0  # the tail slot the last commit named

    def _open(self, tail: bool):
        fid, tails_id, name = self._where
        if tail:
            self.tail_ds = h5py.h5d.open(tails_id, name)
            return self.tail_ds
        self.body = h5py.h5d.open(fid, name)
        return self.body

    def extend(self, records: np.ndarray, *, last: bool = False) -> None:
        """Whole chunks into the body; the rest stays in `tail` (memory only) until write_tail.
        last: nothing follows (the run is closing): every row into the body."""
        buf = concat([self.tail, records]) if len(self.tail) else records
        full = len(buf) if last else len(buf) - len(buf) % self.rows
        if full:
            self._grow(buf[:full])
        self.tail = buf[full:]

    def write_tail(self) -> None:
        """The rows after the body into the other slot (the committed one stays intact until
        the next commit, which names this one)."""
        self.slot = 1 - self.slot
        if len(self.tail):
            ds = self._open(tail=True) if self.tail_ds is None else self.tail_ds
            _write_at(ds, (self.slot, 0), self.tail)
            ds.flush()

    def append(self, records: np.ndarray, *, last: bool = False) -> None:
        """extend + write_tail; last: every row into the body, the last chunk partial, without
        the tail slot's write and flush (finish() in one)."""
        self.extend(records, last=last)
        if not last:
            self.write_tail()

    def finish(self) -> None:
        """Everything into the body (the last chunk partial), tails empty."""
        if len(self.tail):
            self._grow(self.tail)
            self.tail = self.tail[:0]

    def _grow(self, rows: np.ndarray) -> None:
        body = self._open(tail=False) if self.body is None else self.body
        body.set_extent((self.nb + len(rows),))
        _write_at(body, (self.nb,), rows)
        self.nb += len(rows)


def _write_at(ds, at: tuple, rows: np.ndarray) -> None:
    """ds[at[0], at[1]:at[1] + n] = rows (1-D records; ds a low-level DatasetID): the
    high-level selection builds a selection object per write, a dozen writes per flush; and
    the memory type of the records' dtype made once (h5py makes it anew at every write)."""
    rows = np.ascontiguousarray(rows)
    space = ds.get_space()
    space.select_hyperslab(at, (1,) * (len(at) - 1) + (len(rows),))
    ds.write(h5py.h5s.create_simple((len(rows),)), space, rows, mtype=_mtype(rows.dtype))


_MTYPES: dict[np.dtype, object] = {}


def _mtype(dt: np.dtype):
    t = _MTYPES.get(dt)
    if t is None:
        t = _MTYPES[dt] = h5py.h5t.py_create(dt)
    return t


def concat(arrs: list[np.ndarray]) -> np.ndarray:
    """np.concatenate of record arrays of one dtype, without its dtype promotion (Python code
    in numpy for compound dtypes: most of a small concatenation's time)."""
    dt = arrs[0].dtype
    if any(a.dtype != dt for a in arrs):
        return np.concatenate(arrs)
    out = np.empty(sum(map(len, arrs)), dt)
    i = 0
    for a in arrs:
        out[i:i + len(a)] = a
        i += len(a)
    return out


class Commit:
    """/commit, int64 [1 + tables, 3]: row 0 (sequence, 0, 0), then per table (rows in
    the body, rows in the tail, tail slot). Written after everything it names is on
    disk: a reader (or a killed run's file) sees whole flushes only. (Low-level writes, as
    _write_at, for the same reason.)"""

    def __init__(self, f: h5py.File, tables: dict[str, TableFile]):
        self.f, self.tables = f, tables
        self.ds = h5py.h5d.open(f.id, S.COMMIT.encode())
        self.seq = 0

    def write(self) -> None:
        self.seq += 1
        rows = [(self.seq, 0, 0)] + [(t.nb, len(t.tail), t.slot) for t in self.tables.values()]
        self.ds.write(h5py.h5s.ALL, h5py.h5s.ALL, np.array(rows, np.int64))
        self.f.flush()

    def completed(self) -> None:
        """/status = 1 (on disk with the file's next flush or its close)."""
        h5py.h5d.open(self.f.id, S.STATUS.encode()).write(h5py.h5s.ALL, h5py.h5s.ALL, np.ones(1, np.int8))


# Run-independent files, as bytes: a run whose header is one a recent run had (a bench's
# repetitions, serial then concurrent of one `divergence run`, a sweep's runs) starts from a
# copy of it: making the ~35 HDF5 objects is several times the cost of copying the bytes and
# reopening them (the flush thread's time, but on a 2-core CPU that is the engine's time too).
_SKELETONS: dict[tuple, tuple[object, bytes]] = {}  # key -> (the vocab list it holds, file bytes)
MAX_SKELETONS = 4  # (a 152k vocabulary's skeleton is ~1.5 MB)


def create(path: Path, info, *, top_k: int, kv_hashes: bool, kv_hash: str, codes: dict,
           widths: dict, dtypes: dict[str, np.dtype], mode: int | None = None) -> tuple[h5py.File, dict, "Commit"]:
    """A new trace file in SWMR mode with every table created, of the record `dtypes` the
    writer encodes into (schema.record_dtype at `widths`): (file, tables, commit).
    Made under a temporary name and renamed once in SWMR mode, so that a reader never
    opens it half made (HDF5 refuses that file with a lock error). Everything but the
    `created` time is the skeleton's (see _SKELETONS): the same header always gives a file
    that reads the same, whether it was built here or copied. mode: the file's permission
    bits from its creation on (0o600: a trace of users' prompts), else the umask's."""
    args = dict(top_k=top_k, kv_hashes=kv_hashes, kv_hash=kv_hash, codes=codes, widths=widths, dtypes=dtypes)
    key = _skeleton_key(info, args)
    tmp = temp_name(path, "new")  # unique: two writers of one path never share it
    f = None
    try:
        got = _SKELETONS.get(key)
        if got is None or got[0] is not info.vocab:  # (the vocabulary is keyed by identity: held here)
            got = _SKELETONS[key] = (info.vocab, _skeleton(temp_name(path, "skel"), info, args, mode))
            while len(_SKELETONS) > MAX_SKELETONS:
                _SKELETONS.pop(next(iter(_SKELETONS)))
        _new_file(tmp, mode, got[1])
        f = h5py.File(tmp, "r+", libver="latest")
        _set_created(f)
        f.swmr_mode = True  # no new objects or attributes from here on
        tails = h5py.h5g.open(f.id, S.TAILS.encode())
        tables = {name: TableFile(f.id, tails, name.encode(), _chunk_rows(dtypes[name]), dtypes[name])
                  for name in S.TABLES}
        commit = Commit(f, tables)
        f.flush()
        os.replace(tmp, path)
    except BaseException:
        if f is not None:  # a full disk: h5py's close of it would crash later
            close_or_abandon(f)
        tmp.unlink(missing_ok=True)
        raise
    return f, tables, commit


def _set_created(f: h5py.File) -> None:
    """attrs["created"] = now, rewritten in place (the skeleton's attribute, a variable-length
    string: a new value of any length fits; h5py's attrs[...] = deletes and recreates it)."""
    value = np.array(datetime.now(timezone.utc).isoformat(), dtype=h5py.string_dtype())
    h5py.h5a.open(f.id, b"created").write(value)


def _skeleton_key(info, args: dict) -> tuple:
    reqs = tuple((r.id, tuple(r.prompt_tokens), r.arrival, r.max_tokens, r.sampling.temperature, r.sampling.top_p,
                  r.sampling.seed) for r in info.requests)
    dtypes = tuple((n, str(d.descr), d.itemsize) for n, d in args["dtypes"].items())
    header = _json([info.schedule, info.policy, info.settings, info.model, info.draft, info.environment,
                    {k: v for k, v in args.items() if k != "dtypes"}])
    return header, dtypes, reqs, id(info.vocab), len(info.vocab)


def _chunk_rows(dt: np.dtype) -> int:
    return max(16, S.CHUNK_BYTES // dt.itemsize)


def _new_file(path: Path, mode: int | None, data: bytes = b"") -> None:
    """Create `path` (it must not exist) holding `data`, with `mode` from the start (no
    moment where the umask's bits let another user open it); None: the umask's."""
    if mode is None:
        path.write_bytes(data)
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
    with open(fd, "wb") as f:
        f.write(data)


def _skeleton(tmp: Path, info, args: dict, mode: int | None = None) -> bytes:
    """The bytes of a closed file holding the run's whole header and its empty tables."""
    try:
        if mode is not None:
            _new_file(tmp, mode)  # (h5py's "w" truncates it, keeping its mode)
        with h5py.File(tmp, "w", libver="latest") as f:
            _fill(f, info, **args)
        return tmp.read_bytes()
    finally:
        tmp.unlink(missing_ok=True)


def _fill(f: h5py.File, info, *, top_k: int, kv_hashes: bool, kv_hash: str, codes: dict, widths: dict,
          dtypes: dict[str, np.dtype]) -> None:
    f.attrs["format"] = S.FORMAT
    f.attrs["schema_version"] = S.SCHEMA_VERSION
    f.attrs["created"] = datetime.now(timezone.utc).isoformat()
    f.attrs["schedule"] = info.schedule
    f.attrs["policy"] = info.policy
    f.attrs["top_k"] = top_k
    f.attrs["kv_hashes"] = bool(kv_hashes)
    f.attrs["kv_hash"] = kv_hash
    for key, names in codes.items():
        f.attrs[key] = list(names)
    f.attrs["widths"] = _json(widths)
    meta = f.create_group(S.META)
    meta.attrs["settings"] = _json(info.settings)
    meta.attrs["model"] = _json(info.model)
    meta.attrs["draft"] = _json(info.draft)
    meta.attrs["environment"] = _json(info.environment)
    status = f.create_dataset(S.STATUS, data=np.zeros(1, np.int8))
    status.attrs["description"] = "1 when the run completed; 0 while running or if it was killed"
    _write_requests(f, info.requests)
    if info.vocab:
        # bytes + offsets, not vlen strings: token text may hold NUL characters
        pieces = [p.encode("utf-8", "surrogatepass") for p in info.vocab]
        g = f.create_group(S.VOCAB)
        g.attrs["description"] = "token i's text (decoded alone) is bytes[offsets[i]:offsets[i+1]], utf-8"
        raw = np.frombuffer(b"".join(pieces), np.uint8)
        offsets = np.concatenate([[0], np.cumsum([len(p) for p in pieces])]).astype(np.int64)
        for name, data in (("bytes", raw), ("offsets", offsets)):  # ~2.5 MB raw for a 152k vocabulary
            g.create_dataset(name, data=data, chunks=(max(1, min(len(data), 1 << 16)),), **S.COMPRESSION)
        g.attrs[DIGEST] = vocab_digest(raw, offsets)  # readers check it: an edit would print tokens as other text
    tails = f.create_group(S.TAILS)
    for name in S.TABLES:
        dt = dtypes[name]
        rows = _chunk_rows(dt)
        tid = h5py.h5t.py_create(dt, logical=True)
        _dataset(f, name, tid, (0,), (h5py.h5s.UNLIMITED,), (rows,), compress=name not in S.UNCOMPRESSED)
        # small tail chunks: only what a tail holds gets file space (a closed file keeps it)
        _dataset(tails, name, tid, (2, rows), (2, rows), (1, max(1, rows // 8)), compress=False)
    f.attrs["tables"] = _json({name: {"description": t.description,
                                      "columns": {c: col.description for c, col in t.columns.items()}}
                               for name, t in S.TABLES.items()})
    f.attrs["commit_tables"] = list(S.TABLES)
    # chunked, not contiguous: a contiguous dataset's reads can come from the file's sieve buffer,
    # which refreshing the dataset does not drop (a live reader then saw stale commits)
    shape = (1 + len(S.TABLES), 3)
    f.create_dataset(S.COMMIT, data=np.zeros(shape, np.int64), chunks=shape)


def _dataset(parent: h5py.Group, name: str, tid, shape, maxshape, chunks, *, compress: bool) -> h5py.Dataset:
    """An empty chunked dataset, as `create_dataset` makes it (S.COMPRESSION's shuffle +
    gzip when `compress`, no timestamps) through h5py's low-level API: 26 of them per trace,
    at a fifth of the high-level call's cost (its Python runs under the GIL, on the engine's time)."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_chunk(chunks)
    if compress:
        if S.COMPRESSION.get("shuffle"):
            dcpl.set_shuffle()
        assert S.COMPRESSION["compression"] == "gzip"
        dcpl.set_deflate(S.COMPRESSION["compression_opts"])
    dcpl.set_obj_track_times(False)
    space = h5py.h5s.create_simple(shape, maxshape)
    return h5py.Dataset(h5py.h5d.create(parent.id, name.encode(), tid, space, dcpl=dcpl))


def _write_requests(f: h5py.File, requests) -> None:
    g = f.create_group(S.REQUESTS)
    ids = [r.id for r in requests]
    lens = [len(r.prompt_tokens) for r in requests]
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    flat = np.concatenate([np.asarray(r.prompt_tokens, np.int32) for r in requests]) if requests else []
    cols = {
        "id": (np.array(ids, dtype=h5py.string_dtype()), "request id"),
        "prompt_offsets": (offsets, "request i's prompt is prompt_tokens[offsets[i]:offsets[i+1]]"),
        "prompt_tokens": (np.asarray(flat, np.int32), "prompt token ids, concatenated"),
        "arrival": (np.array([r.arrival for r in requests], np.int32), "target step at which it may start"),
        "max_tokens": (np.array([r.max_tokens for r in requests], np.int32), "tokens to generate at most"),
        "temperature": (np.array([r.sampling.temperature for r in requests], np.float64), "0 = greedy"),
        "top_p": (np.array([r.sampling.top_p for r in requests], np.float64), "nucleus sampling mass"),
        "seed": (np.array([r.sampling.seed for r in requests], np.int64), "sampling seed"),
    }
    for name, (data, desc) in cols.items():
        d = g.create_dataset(name, data=data)
        d.attrs["description"] = desc


# -- reading ---------------------------------------------------------------------------------
def read_commit(f: h5py.File, *, refresh: bool) -> tuple[int, dict[str, tuple[int, int, int]]]:
    """(sequence, table -> (body rows, tail rows, tail slot)) as last committed."""
    d = f[S.COMMIT]
    if refresh:
        d.refresh()
    c = d[()]
    names = [x.decode() if isinstance(x, bytes) else str(x) for x in f.attrs["commit_tables"]]
    return int(c[0, 0]), {n: (int(c[i + 1, 0]), int(c[i + 1, 1]), int(c[i + 1, 2])) for i, n in enumerate(names)}


def read_rows(f: h5py.File, name: str, n: int, *, refresh: bool) -> np.ndarray:
    """The first n records of a table (n within what some commit named)."""
    return read_range(f, name, 0, n, refresh=refresh)


def read_range(f: h5py.File, name: str, lo: int, hi: int, *, refresh: bool, commit=None) -> np.ndarray:
    """Records [lo, hi) of a table (hi within what some commit named): the body's, then the
    committed tail slot's. Rows, once committed, never change: the body only grows, and a
    tail slot is rewritten only after the next commit is on disk, which a reader of a live
    file checks. commit: the commit record of a file no writer has open (read once)."""
    body = f[name]
    if hi <= lo:
        return body[0:0]
    for _ in range(1000):
        seq, now = (None, commit) if commit is not None and not refresh else read_commit(f, refresh=refresh)
        nb, _, slot = now[name]
        if refresh:
            body.refresh()
        if hi <= nb:
            return body[lo:hi]
        head = body[lo:nb] if lo < nb else body[0:0]
        tails = f[S.TAILS][name]
        if refresh:
            tails.refresh()  # its chunks may have been allocated since this reader looked
        tail = tails[slot, max(lo - nb, 0): hi - nb]
        # the writer fills a slot before the commit naming it: the slot we read is rewritten
        # while the second commit after ours is being written, so any commit since means retry
        if not refresh or read_commit(f, refresh=True)[0] == seq:
            return np.concatenate([head, tail])
    raise OSError(f"/{name} kept changing while it was read")
