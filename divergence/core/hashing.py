"""64-bit hashes of KV-cache bytes: xxh3_64 of each position's exact bytes.

One call hashes every row of a step (K and V together: kv_events.StepKv). Each row is one
call of xxhash's C xxh3: a numpy form of xxh3 over all rows at once gives the same hashes
but is several times slower than these calls (bench/bench_hashing.py measures both).
"""
from __future__ import annotations

import numpy as np
import xxhash

HASH_NAME = "xxh3_64"


def hash_rows(arr: np.ndarray) -> np.ndarray:
    """uint64 [count]: the xxh3_64 of each row's contiguous little-endian bytes."""
    a = np.ascontiguousarray(arr)
    if a.dtype.byteorder == ">":
        a = a.byteswap().view(a.dtype.newbyteorder("<"))
    width = a.dtype.itemsize * int(np.prod(a.shape[1:]))  # not -1: a step may have no rows
    rows = a.reshape(a.shape[0], -1 if a.shape[0] else 0).view(np.uint8).reshape(a.shape[0], width)
    f = xxhash.xxh3_64_intdigest
    return np.fromiter((f(r) for r in rows), dtype=np.uint64, count=rows.shape[0])
