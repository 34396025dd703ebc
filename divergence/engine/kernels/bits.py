"""The exact bits of an MLX array, as numpy unsigned integers of the element width.

One function for every place that compares or hashes stored values bit for bit (KV
hashes, native-class probe signatures, op-by-op comparisons): bf16 has no numpy
dtype, so values are read through an integer view, never converted.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

_WIDTH = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


def raw_bits(a: mx.array) -> np.ndarray:
    """Same shape as `a`, each element's bits as uint8/16/32/64 (evaluates `a`)."""
    return np.array(a.view(_WIDTH[a.dtype.size]))


def raw_rows(a: mx.array) -> np.ndarray:
    """[n, ...] -> [n, bytes] uint8: each row's exact stored bytes, for hashing."""
    b = raw_bits(a)
    return np.ascontiguousarray(b).reshape(a.shape[0], -1).view(np.uint8)
