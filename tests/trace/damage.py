"""Edits that damage a real trace the way h5py (or a bad copy) can, each past the checks at open.

Each edit takes an h5py.File opened r+ on a copy of a completed trace."""
from __future__ import annotations

import h5py
import numpy as np

from divergence.trace import schema as S


def _rewrite(f, name, fn):
    """Table `name` replaced by fn(records) (same dataset name, commit record left alone)."""
    rec = f[name][()]
    del f[name]
    f.create_dataset(name, data=fn(rec), maxshape=(None,), chunks=True)


def _set(f, name, col, rows, value):
    rec = f[name][()]
    rec[col][rows] = value
    f[name][...] = rec


def requests_short(f):
    """The request table shorter than the records that reference it."""
    g = f[S.REQUESTS]
    for k in list(g):
        data = g[k][()]
        del g[k]
        g.create_dataset(k, data=data[:3] if k == "prompt_offsets" else data[:2])


def tokens_plain(f):
    """/tokens a plain int array, not the compound table."""
    _rewrite(f, "tokens", lambda rec: rec["token"].astype(np.int64))


def steps_plain(f):
    """/steps a plain int array."""
    _rewrite(f, "steps", lambda rec: rec["index"].astype(np.int64))


def tokens_column_dtype(f):
    """/tokens with its token column stored as strings."""
    def fn(rec):
        dt = np.dtype([(n, "S4" if n == "token" else rec.dtype[n]) for n in rec.dtype.names])
        out = np.zeros(len(rec), dt)
        for n in rec.dtype.names:
            out[n] = rec[n].astype("S4") if n == "token" else rec[n]
        return out
    _rewrite(f, "tokens", fn)


def meta_json(f):
    f[S.META].attrs["settings"] = "{not json"


def hash_offset(f):
    _set(f, "kv_writes", "hash_offset", slice(5, 6), 10**9)


def op_code(f):
    _set(f, "kernels", "op", slice(7, 8), 99)


def slice_offset(f):
    _set(f, "steps", "slice_offset", slice(3, 4), 10**6)


def tokens_cut(f):
    """A completed trace whose tokens table lost its second half (the commit record still names it all)."""
    _rewrite(f, "tokens", lambda rec: rec[: len(rec) // 2])


def tokens_cut_commit(f):
    """The same cut, the commit record cut to match (a completed trace that lacks tokens)."""
    n = f["tokens"].shape[0]
    tokens_cut(f)
    names = [x.decode() if isinstance(x, bytes) else str(x) for x in f.attrs["commit_tables"]]
    c = f[S.COMMIT][()]
    c[1 + names.index("tokens")] = (n // 2, 0, 0)
    f[S.COMMIT][...] = c


def logits_nan(f):
    """Every recorded top-k logit NaN."""
    _set(f, "tokens", "topk_logits", slice(None), np.nan)


def token_request(f):
    """A token record naming request 7 of 4."""
    _set(f, "tokens", "request", slice(10, 11), 7)


EDITS = {fn.__name__: fn for fn in (requests_short, tokens_plain, steps_plain, tokens_column_dtype, meta_json,
                                     hash_offset, op_code, slice_offset, tokens_cut, tokens_cut_commit, logits_nan,
                                     token_request)}


def damage(src, dst, edit: str):
    import shutil

    shutil.copyfile(src, dst)
    with h5py.File(dst, "r+") as f:
        EDITS[edit](f)
    return dst
