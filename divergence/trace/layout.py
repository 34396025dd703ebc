"""The schema-2 file: created at run start, appended table by table, compacted at the end.

While a run writes, every table is one chunked, resizable, *uncompressed* compound
dataset: appending a few records to a compressed chunk rewrites the chunk elsewhere
in the file each flush (a 0.5B-shaped run grew 7x that way), while an uncompressed
chunk is written in place. A completed trace is rewritten once, compressed
(`compact`); a killed run keeps the uncompressed file, readable as it is.
"""
from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

import h5py
import numpy as np

from . import schema as S


def _json(obj) -> str:
    return json.dumps(obj, default=str, sort_keys=True)


class TableFile:
    """Appends record arrays to one table's dataset."""

    def __init__(self, ds: h5py.Dataset):
        self.ds = ds
        self.n = 0

    def append(self, records: np.ndarray) -> None:
        k = len(records)
        if k:
            self.ds.resize((self.n + k,))
            self.ds[self.n:] = records
            self.n += k


def create(path: Path, info, *, top_k: int, kv_hashes: bool, kv_hash: str, codes: dict,
           widths: dict) -> tuple[h5py.File, dict, dict]:
    """A new trace file in SWMR mode with every table created: (file, tables, dtypes)."""
    f = h5py.File(path, "w", libver="latest")
    try:
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
            g.create_dataset("bytes", data=np.frombuffer(b"".join(pieces), np.uint8))
            g.create_dataset("offsets", data=np.concatenate([[0], np.cumsum([len(p) for p in pieces])]))
        tables, dtypes = {}, {}
        for name, t in S.TABLES.items():
            dt = dtypes[name] = S.record_dtype(t, widths)
            d = f.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dt,
                                 chunks=(max(16, S.CHUNK_BYTES // dt.itemsize),))
            _describe(d, t)
            tables[name] = TableFile(d)
        f.swmr_mode = True  # no new objects or attributes from here on
        f.flush()
    except BaseException:
        f.close()
        raise
    return f, tables, dtypes


def _describe(d: h5py.Dataset, t: S.Table) -> None:
    d.attrs["description"] = t.description
    d.attrs["columns"] = _json({name: c.description for name, c in t.columns.items()})


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


SLAB = 1 << 20  # records copied at a time when compacting


def compact(path: Path) -> None:
    """Rewrite a closed, completed trace with compressed tables (same content), atomically:
    on any failure the uncompressed original stays as it is."""
    tmp = path.with_name(path.name + ".compact")
    try:
        with h5py.File(path, "r") as src, h5py.File(tmp, "w", libver=("v110", "latest")) as dst:
            for k, v in src.attrs.items():
                dst.attrs[k] = v
            for name, obj in src.items():
                if name in S.TABLES and isinstance(obj, h5py.Dataset):
                    _copy_table(obj, dst, name)
                else:
                    src.copy(obj, dst, name=name)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _copy_table(src: h5py.Dataset, dst: h5py.File, name: str) -> None:
    n = src.shape[0]
    rows = max(16, min(max(n, 1), S.CHUNK_BYTES * 4 // src.dtype.itemsize))
    d = dst.create_dataset(name, shape=(n,), maxshape=(None,), dtype=src.dtype, chunks=(rows,), **S.COMPRESSION)
    for lo in range(0, n, SLAB):
        d[lo: lo + SLAB] = src[lo: lo + SLAB]
    for k, v in src.attrs.items():
        d.attrs[k] = v
