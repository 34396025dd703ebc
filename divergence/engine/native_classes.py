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
bf16 value, so one probe row often hides a kernel switch (seen on the H200: one row
called the fixture's linear ops batch-invariant, real hidden states said otherwise).
"""
from __future__ import annotations

from typing import Callable

import mlx.core as mx
import numpy as np
import xxhash

from . import kernels
from .kernels import LinearOp

PROBE_ROWS = 32  # rows whose outputs make the signature
PROBE_POOL_ROWS = 64  # distinct random input rows, tiled for calls of more rows
PROBE_SEED = 7


def bits(a: mx.array) -> np.ndarray:
    """The raw bits of an array as unsigned integers of its width."""
    width = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[a.dtype.size]
    return np.array(a.view(width))


class NativeClassProbe:
    """Memoised class signatures of linear ops (per op name and shape: the first module
    of a shape stands for every layer's). `run(x, op)` is the native op by default."""

    def __init__(self, run: Callable[[mx.array, LinearOp], mx.array] | None = None):
        self._run = run
        self._sig: dict[tuple, int] = {}
        self._pool: dict[tuple, mx.array] = {}

    def _input(self, k: int, dtype) -> mx.array:
        key = (k, str(dtype))
        if key not in self._pool:
            self._pool[key] = mx.random.normal((PROBE_POOL_ROWS, k), key=mx.random.key(PROBE_SEED)).astype(dtype)
        return self._pool[key]

    def outputs(self, op: LinearOp, m: int, dtype) -> np.ndarray:
        """The first PROBE_ROWS output rows, computed in calls of exactly m rows, as bits."""
        run = self._run or kernels.run_native  # looked up per call: tests swap the backend
        pool = self._input(op.k, dtype)
        outs, done = [], 0
        while done < PROBE_ROWS:
            idx = (np.arange(done, done + m) % PROBE_POOL_ROWS).astype(np.int32)
            y = run(pool[mx.array(idx)], op)[: PROBE_ROWS - done]
            mx.eval(y)
            outs.append(bits(y))
            done += y.shape[0]
        return np.concatenate(outs, axis=0)

    def signature(self, op: LinearOp, m: int, dtype) -> int:
        key = (op.name, op.n, op.k, str(dtype), m)
        sig = self._sig.get(key)
        if sig is None:
            out = np.ascontiguousarray(self.outputs(op, m, dtype))
            sig = xxhash.xxh3_64_intdigest(out.tobytes()) or 1  # never 0: 0 marks "not native"
            self._sig[key] = sig
        return sig

    def classes(self, op: LinearOp, rows: list[int], dtype) -> list[int]:
        """Class per row count: 0 = the one-row class, then 1, 2, ... in order of appearance."""
        ids = {self.signature(op, 1, dtype): 0}
        return [ids.setdefault(self.signature(op, m, dtype), len(ids)) for m in rows]
