"""Which kernel class a backend's native linear op falls into at a given row count.

A real backend picks its matmul kernel from the shape (GEMV at one row, tiled GEMM
with some split-K above), and only the bits say which. The probe: run the native op
on a fixed input at M rows and read row 0's output bits; its 64-bit hash is the
*class signature* of M. Two row counts with the same signature computed row 0 the
same way; the signature at M = 1 is the serial, one-row class. Signatures are
deterministic per (backend, device, model weights, op, M), so traces made on the
same machine compare: bisect says "k_proj's native class changed between 1 and 8
rows" instead of only "rows differ". `divergence probe` maps whole row ranges.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import xxhash

from . import kernels
from .kernels import LinearOp

PROBE_POOL_ROWS = 64  # distinct probe rows, tiled up to M: row 0 is the same input at every M
PROBE_SEED = 7


def bits(a: mx.array) -> np.ndarray:
    """The raw bits of an array as unsigned integers of its width."""
    width = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[a.dtype.size]
    return np.array(a.view(width))


class NativeClassProbe:
    """Memoised class signatures for one model's linear ops (first module of each shape)."""

    def __init__(self):
        self._sig: dict[tuple, int] = {}
        self._pool: dict[tuple, mx.array] = {}

    def signature(self, op: LinearOp, m: int, dtype) -> int:
        key = (op.name, op.n, op.k, str(dtype), m)
        sig = self._sig.get(key)
        if sig is None:
            pool = self._pool.get((op.k, str(dtype)))
            if pool is None:
                pool = mx.random.normal((PROBE_POOL_ROWS, op.k), key=mx.random.key(PROBE_SEED)).astype(dtype)
                self._pool[(op.k, str(dtype))] = pool
            x = pool if m == PROBE_POOL_ROWS else pool[mx.array(np.arange(m) % PROBE_POOL_ROWS)]
            y = kernels.run_native(x, op)[0]  # whatever "native" is here (tests swap it)
            mx.eval(y)
            # never 0: 0 marks "not a native kernel" in traces
            sig = xxhash.xxh3_64_intdigest(np.ascontiguousarray(bits(y)).tobytes()) or 1
            self._sig[key] = sig
        return sig
