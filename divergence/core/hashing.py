"""64-bit hashes of KV-cache bytes: xxh3_64 of each position's exact bytes."""
from __future__ import annotations

import numpy as np
import xxhash

HASH_NAME = "xxh3_64"


def hash_rows(arr: np.ndarray) -> np.ndarray:
    """uint64 [count]: the xxh3_64 of each row's contiguous little-endian bytes."""
    a = np.ascontiguousarray(arr)
    if a.dtype.byteorder == ">":
        a = a.byteswap().view(a.dtype.newbyteorder("<"))
    rows = a.reshape(a.shape[0], -1).view(np.uint8).reshape(a.shape[0], -1)
    f = xxhash.xxh3_64_intdigest
    return np.fromiter((f(r) for r in rows), dtype=np.uint64, count=rows.shape[0])
