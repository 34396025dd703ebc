"""64-bit hashes of KV-cache bytes: xxh3_64 of each position's exact bytes.

One call hashes every row of a step (K and V together: kv_events.StepKv). Each row is one
call of xxhash's C xxh3: a numpy form of xxh3 over all rows at once gives the same hashes
but is slower than these calls (it runs xxh3's rounds as whole-array numpy ops). The
rows are the rows of a 2-D uint8 array, handed to xxh3 by `map` in C: no Python bytecode
runs per row, and no per-row object is made beyond numpy's row view (byte ranges as slice
objects of a memoryview cost more, building the slices most of it).
"""
from __future__ import annotations

import numpy as np
import xxhash

HASH_NAME = "xxh3_64"
_XXH3 = xxhash.xxh3_64_intdigest


def hash_byte_rows(rows: np.ndarray) -> np.ndarray:
    """uint64 [n]: the xxh3_64 of each row of a C-contiguous [n, bytes] uint8 array."""
    return np.fromiter(map(_XXH3, rows), dtype=np.uint64, count=len(rows))


def hash_rows(arr: np.ndarray, order: np.ndarray | None = None) -> np.ndarray:
    """uint64 [count]: the xxh3_64 of each row's contiguous little-endian bytes; with `order`,
    of rows `order` only, in that order."""
    a = np.ascontiguousarray(arr)
    if a.dtype.byteorder == ">":
        a = a.byteswap().view(a.dtype.newbyteorder("<"))
    width = a.dtype.itemsize * int(np.prod(a.shape[1:]))  # not -1: a step may have no rows
    rows = a.reshape(-1).view(np.uint8).reshape(a.shape[0], width)
    return hash_byte_rows(rows if order is None else rows[order])
