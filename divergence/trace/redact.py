"""A pair of traces without its text: what `divergence redact` writes.

Every token id of both traces (prompts, generated tokens, top-k ids, step inputs, draws)
goes through one random permutation of the vocabulary with no fixed point: equal ids stay
equal, so the divergence, the margins, the kernels and the root cause read the same, and
no id is its own. The vocabulary goes. The content hashes (the K/V hashes, the MoE router's
input hashes) go through one keyed hash: equal stay equal, but nobody can match them to
hashes computed from a public model's weights, which would give each prompt token back
(a layer-0 K/V depends on one token and its position). The permutation and the key come
from the OS's randomness and are kept by nobody: not in the files, not printed.

The copies are built object by object into new files (a rewritten chunk in place would
leave the old bytes in the file's free space), written to temporary names and renamed.
Token-id fields of the recorded model configs (eos_token_id, ...) are permuted too, and
the root attribute `redacted` marks the copy: a replay refuses it (it needs real tokens).
See docs/privacy.md.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
from datetime import datetime, timezone
from pathlib import Path

import h5py
import numpy as np

from ..core.atomic import temp_name
from ..errors import DivergenceInputError, TraceError
from . import schema as S
from .reader import Trace

REDACTED_ATTR = "redacted"
# Where a trace holds token ids: schema-2 tables (their tail slots too) -> columns; schema 1
# stored the same columns as datasets under each table's v1 group.
TOKEN_COLUMNS = {"slice_tokens": ("value",), "tokens": ("token", "topk_ids"),
                 "draws": ("token", "prev_token", "next_token"), "live_prompt_tokens": ("value",)}
HASH_COLUMNS = {"kv_hashes": ("k_hash", "v_hash"), "routing": ("input_hash",)}
TOKEN_DATASETS = (f"{S.REQUESTS}/prompt_tokens",)
DROPPED = (S.VOCAB,)
BLOCK_ROWS = 1 << 16  # rows read, changed and written at a time
TOKENS, HASHES = "tokens", "hashes"


def is_redacted(trace) -> bool:
    """Whether a trace (a Trace or an h5py.File) is a redacted copy."""
    f = getattr(trace, "f", trace)
    return f is not None and REDACTED_ATTR in f.attrs


class Redaction:
    """One pair's secret: a derangement of range(vocab) and a hash key (never stored)."""

    def __init__(self, vocab: int, *, seed: int | None = None, key: bytes | None = None):
        if vocab < 2:
            raise DivergenceInputError(f"a vocabulary of {vocab} token ids has no permutation without a fixed point")
        rng = np.random.default_rng(secrets.randbits(128) if seed is None else seed)
        ids = np.arange(vocab)
        while True:  # a uniform derangement: 1 permutation in e has no fixed point
            perm = rng.permutation(vocab)
            if not (perm == ids).any():
                break
        self.vocab = vocab
        self.perm = perm.astype(np.int64)
        self.key = secrets.token_bytes(32) if key is None else key

    def tokens(self, a: np.ndarray) -> np.ndarray:
        """Token ids permuted; negative ones (padding, 'none') kept."""
        a = np.asarray(a)
        out = a.copy()
        real = a >= 0
        if real.any() and int(a[real].max()) >= self.vocab:
            raise TraceError(f"a token id {int(a[real].max())} is outside the vocabulary ({self.vocab} ids)")
        out[real] = self.perm[a[real]].astype(a.dtype)
        return out

    def hashes(self, a: np.ndarray) -> np.ndarray:
        """64-bit hashes through a keyed BLAKE2b (0, 'not recorded', kept)."""
        a = np.asarray(a)
        uniq, inverse = np.unique(a.ravel(), return_inverse=True)
        keyed = np.fromiter((0 if x == 0 else int.from_bytes(hashlib.blake2b(
            x.to_bytes(8, "little"), key=self.key, digest_size=8).digest(), "little") for x in uniq.tolist()),
            np.uint64, len(uniq))
        return keyed[inverse].reshape(a.shape).astype(a.dtype)

    def json_ids(self, obj):
        """A JSON value with every `*_token_id` / `*_token_ids` integer permuted."""
        if isinstance(obj, dict):
            return {k: (self._id_value(v) if k.endswith(("_token_id", "_token_ids")) else self.json_ids(v))
                    for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.json_ids(v) for v in obj]
        return obj

    def _id_value(self, v):
        if isinstance(v, bool):
            return v
        if isinstance(v, int):
            return int(self.perm[v]) if 0 <= v < self.vocab else v
        if isinstance(v, list):
            return [self._id_value(x) for x in v]
        return v


def vocab_size(traces) -> int:
    """The id space the permutation covers: the largest of the models' vocab_size, the
    vocabularies' lengths and every id the traces hold, plus one."""
    n = 0
    for t in traces:
        for m in (t.meta.get("model"), t.meta.get("draft")):
            v = ((m or {}).get("config") or {}).get("vocab_size")
            if isinstance(v, int) and not isinstance(v, bool):
                n = max(n, v)
        if t.vocab is not None:
            n = max(n, len(t.vocab))
        for path, fields in _token_places(t.f):
            ds = t.f[path]
            for i in range(0, ds.shape[0] if ds.ndim else 0, BLOCK_ROWS):
                block = ds[i: i + BLOCK_ROWS]
                for name in fields:
                    col = block if name is None else block[name]
                    if col.size:
                        n = max(n, int(col.max()) + 1)
    return n


def _token_places(f: h5py.File):
    """(dataset path, fields: compound field names, or [None] for the whole array) of token ids."""
    for path, changes in _changes(f).items():
        fields = [c for c, kind in changes.items() if kind == TOKENS]
        if fields and path in f:
            yield path, fields


def _changes(f: h5py.File) -> dict[str, dict]:
    """dataset path -> {field (None: the whole dataset): TOKENS | HASHES}."""
    out: dict[str, dict] = {p: {None: TOKENS} for p in TOKEN_DATASETS}
    version = int(f.attrs.get("schema_version", S.SCHEMA_VERSION))
    for kind, columns in ((TOKENS, TOKEN_COLUMNS), (HASHES, HASH_COLUMNS)):
        for table, cols in columns.items():
            if version >= 2:
                for path in (table, f"{S.TAILS}/{table}"):
                    out.setdefault(path, {}).update({c: kind for c in cols})
            elif S.TABLES[table].v1:
                for c in cols:
                    out[f"{S.TABLES[table].v1}/{c}"] = {None: kind}
    return out


def redact_pair(a_path, b_path, out_dir, *, names: tuple[str, str]) -> tuple[Path, Path]:
    """Write redacted copies of traces A and B as out_dir/names[0], out_dir/names[1] (the
    directory created if need be); returns their paths. Inputs are validated first (a damaged
    trace is one TraceError); nothing is left behind on failure."""
    out = Path(out_dir)
    opened = []
    try:
        for p in (a_path, b_path):
            t = Trace.open(p)
            opened.append(t)
            if is_redacted(t):
                raise DivergenceInputError(f"{p} is already redacted: redact the original pair (both traces at "
                                           f"once, so that they share one permutation)")
        red = Redaction(vocab_size(opened))
        out.mkdir(parents=True, exist_ok=True)
        targets = [out / n for n in names]
        tmps = [temp_name(p, "partial") for p in targets]
        try:
            for t, tmp in zip(opened, tmps):
                _write_redacted(t, tmp, red)
            for tmp, target in zip(tmps, targets):
                os.replace(tmp, target)
        finally:
            for tmp in tmps:
                tmp.unlink(missing_ok=True)
        return targets[0], targets[1]
    finally:
        for t in opened:
            t.close()


def _write_redacted(t: Trace, tmp: Path, red: Redaction) -> None:
    src = t.f
    changes = _changes(src)
    with h5py.File(tmp, "x", libver="latest") as dst:
        _copy_attrs(src, dst)
        dst.attrs[REDACTED_ATTR] = json.dumps({
            "at": datetime.now(timezone.utc).isoformat(), "tokens": f"permuted: one derangement of {red.vocab} ids "
            "for the pair, kept by nobody", "vocab": "removed", "hashes": "keyed (equal stay equal)"})
        _copy_group(src, dst, changes, red)
        meta = dst[S.META]
        for k in ("model", "draft", "settings"):
            if k in meta.attrs:
                meta.attrs[k] = json.dumps(red.json_ids(json.loads(meta.attrs[k])), sort_keys=True)


def _copy_group(src: h5py.Group, dst: h5py.Group, changes: dict, red: Redaction) -> None:
    for name, obj in src.items():
        path = obj.name.lstrip("/")
        if path in DROPPED:
            continue
        if isinstance(obj, h5py.Group):
            g = dst.create_group(name)
            _copy_attrs(obj, g)
            _copy_group(obj, g, changes, red)
        elif path in changes:
            _rewrite(obj, dst, name, changes[path], red)
        else:
            src.file.copy(obj, dst, name=name)  # (H5Ocopy: its attributes and storage as they are)


def _rewrite(ds: h5py.Dataset, dst: h5py.Group, name: str, fields: dict, red: Redaction) -> None:
    """A dataset created like `ds` in dst, written once with its token ids / hashes changed."""
    kw = dict(shape=ds.shape, dtype=ds.dtype, maxshape=ds.maxshape, chunks=ds.chunks, compression=ds.compression,
              compression_opts=ds.compression_opts, shuffle=ds.shuffle, fletcher32=ds.fletcher32)
    if ds.chunks is None:
        kw.pop("maxshape")
    out = dst.create_dataset(name, **kw)
    _copy_attrs(ds, out)
    n = ds.shape[0] if ds.ndim else 0
    for i in range(0, n, BLOCK_ROWS):
        block = ds[i: i + BLOCK_ROWS]
        for field, kind in fields.items():
            change = red.tokens if kind == TOKENS else red.hashes
            if field is None:
                block = change(block)
            elif field in (block.dtype.names or ()):
                block[field] = change(block[field])
        out[i: i + len(block)] = block


def _copy_attrs(src, dst) -> None:
    for k in src.attrs:
        aid = src.attrs.get_id(k)
        dst.attrs.create(k, src.attrs[k], shape=aid.shape, dtype=aid.dtype)
