"""Which kernel class a backend's native linear op falls into at a given row count.

A real backend picks its matmul kernel from the shape (GEMV at one row, tiled GEMM
with some split-K above), and only the bits say which. The probe: compute the
outputs of a fixed set of PROBE_ROWS input rows with calls of exactly M rows each;
the 64-bit hash of those outputs is the *class signature* of M. Two row counts with
the same signature computed every probe row the same way; the signature at M = 1
is the one-row class (each row alone, as a serial decode step computes it).
Signatures are deterministic per (backend, device, weights, op, M), so traces made
on one machine compare: bisect says "gate_proj's native class changed between 1 and
8 rows" instead of only "rows differ". `divergence probe` maps whole row ranges.

Why many rows: with bf16 outputs a reordered fp32 sum usually rounds to the same
bf16 value, so one probe row often hides a kernel switch (seen on a GPU: one row
called the fixture's linear ops batch-invariant, real hidden states said otherwise).
What hides a switch is too few output *values*, so an op gets rows up to
PROBE_VALUES values: 32 rows of every op up to 8,192 columns, fewer of a wide one. A
vocabulary head (151,936 columns on Qwen2.5) gets 2 rows: 32 one-row calls of it had
read its 545 MB of fp32 weights 32 times in every `divergence run`.

Signatures are kept on disk (backend_proofs.BackendStore: per backend fingerprint, in the
user cache dir, off with DIVERGENCE_PROOF_CACHE=off), so a run does not probe again what an
earlier process on this backend probed. A linear op's key names its weights (the model's
file hash and a digest of sampled weight rows, which tells tensor-parallel shards and
dtype casts apart), its shape, dtype and M; only the backend's own kernels are stored, never
a stand-in's (a `run` given, or a test's swapped kernels).
"""
from __future__ import annotations

from typing import Callable

import mlx.core as mx
import numpy as np
import xxhash

from ...core.classes import classify
from ...core.names import BATCHED, PADDED, PER_SEQ
from . import attention, linear as kernels, splits as cpu_split
from .backend_proofs import BackendStore
from .bits import raw_bits
from .linear import LinearOp

PROBE_ROWS = 32  # rows whose outputs make the signature (at most)
PROBE_VALUES = PROBE_ROWS * 8192  # output values enough to show a kernel switch
PROBE_POOL_ROWS = 64  # distinct random input rows, tiled for calls of more rows
PROBE_SEED = 7
PROBE_METHOD = 1  # part of every stored key: a change of the probe above must not reuse old signatures
DIGEST_ROWS = 16  # weight rows sampled into a linear op's key

SIGNATURES = BackendStore("native-classes")  # one per process: the backend is the process's
def _own_kernels() -> bool:
    """Whether the probes run the backend's own kernels (a signature is stored or read only
    then). Compared with the functions their modules defined, not with what those names held
    when this module was first imported: a stand-in swapped in before that import (a test's
    split-KV attention) once passed for the own kernel and wrote its signature into the user's
    cache, where every later process read it (bisect then named no op)."""
    return (kernels.run_native, attention.run_per_seq, attention.run_batched) == (kernels.OWN_NATIVE,
                                                                                  *attention.OWN_KERNELS)


def _weights_digest(op: LinearOp) -> str:
    """xxh3 of DIGEST_ROWS evenly spaced rows of the op's weight arrays (weight, scales, biases)."""
    mod = op.module
    parts = [mod.weight] + [mod[name] for name in ("scales", "biases", "bias") if name in mod]
    rows = mx.array(np.linspace(0, mod.weight.shape[0] - 1, DIGEST_ROWS).astype(np.int32))
    taken = [mx.take(a, rows, axis=0) if a.ndim > 1 else a for a in parts]
    mx.eval(*taken)
    h = xxhash.xxh3_64()
    for a in taken:
        h.update(np.ascontiguousarray(raw_bits(a)).tobytes())
    return h.hexdigest()


def probe_rows(n: int) -> int:
    """Rows whose outputs make the signature of an op of n columns: enough for PROBE_VALUES
    values. The same rows at every row count M, or signatures of one kernel would differ."""
    return max(1, min(PROBE_ROWS, -(-PROBE_VALUES // max(n, 1))))


class NativeClassProbe:
    """Memoised class signatures of linear ops (per op name and shape: the first module
    of a shape stands for every layer's). `run(x, op)` is the native op by default."""

    def __init__(self, run: Callable[[mx.array, LinearOp], mx.array] | None = None, *,
                 weights: str | None = None):
        self._run = run
        self._weights = weights  # the model's weights_hash: without it nothing is stored on disk
        self._sig: dict[tuple, int] = {}
        self._pool: dict[tuple, mx.array] = {}
        self._digests: dict[tuple, str] = {}

    def _stored_key(self, op: LinearOp, m: int, dtype) -> str | None:
        if self._run is not None or not self._weights or not _own_kernels():
            return None
        memo = (op.name, op.n, op.k, id(op.module))
        if memo not in self._digests:
            self._digests[memo] = _weights_digest(op)
        return (f"linear:{PROBE_METHOD}:{self._weights}:{self._digests[memo]}:{op.name}:{op.n}x{op.k}:{op.precision}:"
                f"{dtype}:{m}:split={cpu_split.MAY_SPLIT}")

    def _input(self, k: int, dtype) -> mx.array:
        key = (k, str(dtype))
        if key not in self._pool:
            self._pool[key] = mx.random.normal((PROBE_POOL_ROWS, k), key=mx.random.key(PROBE_SEED)).astype(dtype)
        return self._pool[key]

    def outputs(self, op: LinearOp, m: int, dtype) -> np.ndarray:
        """The first probe_rows(n) output rows, computed in calls of exactly m rows, as bits."""
        run = self._run or kernels.run_native  # looked up per call: tests swap the backend
        pool = self._input(op.k, dtype)
        outs, done, want = [], 0, probe_rows(op.n)
        while done < want:
            idx = (np.arange(done, done + m) % PROBE_POOL_ROWS).astype(np.int32)
            y = run(pool[mx.array(idx)], op)[: want - done]
            mx.eval(y)
            outs.append(raw_bits(y))
            done += y.shape[0]
        return np.concatenate(outs, axis=0)

    def signature(self, op: LinearOp, m: int, dtype) -> int:
        key = (op.name, op.n, op.k, str(dtype), m)
        sig = self._sig.get(key)
        if sig is None:
            stored = self._stored_key(op, m, dtype)
            sig = SIGNATURES.get(stored) if stored else None
            if not isinstance(sig, int):
                out = np.ascontiguousarray(self.outputs(op, m, dtype))
                sig = xxhash.xxh3_64_intdigest(out.tobytes()) or 1  # never 0: 0 marks "not native"
                if stored:
                    SIGNATURES.put(stored, sig)
            self._sig[key] = sig
        return sig

    def classes(self, op: LinearOp, rows: list[int], dtype) -> list[int]:
        """Class per row count: 0 = the one-row class, then 1, 2, ... in order of appearance."""
        return classify([self.signature(op, m, dtype) for m in [1, *rows]])[1:]


# Attention: probe sequences of these KV lengths (one shared K/V pool), each with Q query rows.
ATTN_PROBE_LENS = (5, 17, 33, 64, 9, 48, 2, 27)
# how a batched call lays out its sequences: padded on the right (the engine's), on the left
# (mlx-lm BatchGenerator's), or all of one length and unmasked (both, when nothing needs masking)
LAYOUTS = ("right", "left", "equal")


class AttentionClassProbe:
    """Class signatures of the attention kernels, like NativeClassProbe's for linear ops:
    the bits of every probe sequence's output, computed alone (`per-seq`) or in masked
    calls of B sequences each (`batched`; unmasked when they are all of one length).
    A batched signature equal to the per-seq one
    means that batch computes every probe row as the sequences alone do."""

    def __init__(self):
        self._sig: dict[tuple, int] = {}
        self._data: dict[tuple, tuple] = {}

    def _inputs(self, heads: int, kv_heads: int, head_dim: int, queries: int, dtype):
        key = (heads, kv_heads, head_dim, queries, str(dtype))
        if key not in self._data:
            P, L = len(ATTN_PROBE_LENS), max(ATTN_PROBE_LENS) + queries
            r = mx.random
            k = r.normal((P, kv_heads, L, head_dim), key=r.key(PROBE_SEED + 1)).astype(dtype)
            v = r.normal((P, kv_heads, L, head_dim), key=r.key(PROBE_SEED + 2)).astype(dtype)
            q = r.normal((P, heads, queries, head_dim), key=r.key(PROBE_SEED + 3)).astype(dtype)
            self._data[key] = (q, k, v, [n + queries for n in ATTN_PROBE_LENS])
        return self._data[key]

    def outputs(self, kernel: str, batch: int, heads: int, kv_heads: int, head_dim: int, queries: int, dtype,
                *, layout: str = "right") -> np.ndarray:
        """Bits of every probe sequence's [heads, Q, head_dim] output under `kernel`."""
        q, k, v, lens = self._inputs(heads, kv_heads, head_dim, queries, dtype)
        P, scale = len(lens), head_dim ** -0.5
        outs = []
        if kernel == PER_SEQ:
            for i, n in enumerate(lens):
                o = attention.run_per_seq(q[i : i + 1], k[i : i + 1, :, :n], v[i : i + 1, :, :n], scale)
                outs.append(raw_bits(o))
            return np.concatenate(outs)
        assert kernel == BATCHED and layout in LAYOUTS
        if layout == "equal":
            # sequence i in a batch of `batch` sequences cut to its length: no mask
            for i, n in enumerate(lens):
                idx = mx.array(np.asarray([(i + j) % P for j in range(batch)], dtype=np.int32))
                o = attention.run_batched(q[idx], k[idx, :, :n], v[idx, :, :n], None, scale)
                outs.append(raw_bits(o[:1]))
            return np.concatenate(outs)
        done = 0
        while done < P:
            idx = [(done + j) % P for j in range(batch)]
            L = max(lens[i] for i in idx)
            ks, vs, mask = [], [], np.zeros((batch, 1, queries, L), dtype=bool)
            for b, i in enumerate(idx):
                n, pad = lens[i], L - lens[i]
                lo = pad if layout == "left" else 0
                z = mx.zeros((1, kv_heads, pad, head_dim), dtype=q.dtype)
                parts = [k[i : i + 1, :, :n], z] if layout == "right" else [z, k[i : i + 1, :, :n]]
                ks.append(mx.concatenate(parts, axis=2) if pad else parts[0 if layout == "right" else 1])
                parts = [v[i : i + 1, :, :n], z] if layout == "right" else [z, v[i : i + 1, :, :n]]
                vs.append(mx.concatenate(parts, axis=2) if pad else parts[0 if layout == "right" else 1])
                keys = np.arange(L) - lo  # position of each key within the sequence
                qpos = n - queries + np.arange(queries)
                mask[b, 0] = (keys[None, :] >= 0) & (keys[None, :] <= qpos[:, None])
            qb = q[mx.array(np.asarray(idx, dtype=np.int32))]
            o = attention.run_batched(qb, mx.concatenate(ks), mx.concatenate(vs), mx.array(mask), scale)
            take = min(batch, P - done)
            outs.append(raw_bits(o[:take]))
            done += take
        return np.concatenate(outs)

    def signature(self, kernel: str, batch: int, heads: int, kv_heads: int, head_dim: int, queries: int,
                  dtype, *, layout: str = "right") -> int:
        if kernel == PADDED:  # one batched call, its layout the caller's (right- or left-padded)
            kernel = BATCHED
        key = (kernel, batch if kernel == BATCHED else 0, heads, kv_heads, head_dim, queries, str(dtype), layout)
        sig = self._sig.get(key)
        if sig is None:
            stored = f"attention:{PROBE_METHOD}:" + ":".join(map(str, key)) if _own_kernels() else None
            sig = SIGNATURES.get(stored) if stored else None
            if not isinstance(sig, int):
                out = np.ascontiguousarray(self.outputs(kernel, batch, heads, kv_heads, head_dim, queries, dtype,
                                                        layout=layout))
                sig = xxhash.xxh3_64_intdigest(out.tobytes()) or 1
                if stored:
                    SIGNATURES.put(stored, sig)
            self._sig[key] = sig
        return sig
