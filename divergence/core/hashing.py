"""64-bit hashes of KV-cache bytes: xxh3_64 of each position's exact bytes.

One call hashes every row of a step (K and V together: kv_events.StepKv). Each row is one
call of xxhash's C xxh3: a numpy form of xxh3 over all rows at once gives the same hashes
but is several times slower than these calls (bench/bench_hashing.py measures both). The
rows are memoryview slices of the array's buffer, taken and hashed by `map` in C: no Python
bytecode runs per row.
"""
from __future__ import annotations

import numpy as np
import xxhash

HASH_NAME = "xxh3_64"
_XXH3 = xxhash.xxh3_64_intdigest


def row_slices(starts, width: int) -> list[slice]:
    """The byte ranges of rows of `width` bytes that start at rows `starts` (in that order):
    what hash_at takes. A caller whose rows repeat (every decode step of a batch) keeps them."""
    return [slice(j, j + width) for j in (np.asarray(starts, np.int64) * width).tolist()]


def hash_at(buf: memoryview, slices: list[slice]) -> np.ndarray:
    """uint64 [len(slices)]: the xxh3_64 of each byte range of `buf` (a flat byte view)."""
    return np.fromiter(map(_XXH3, map(buf.__getitem__, slices)), dtype=np.uint64, count=len(slices))


def hash_rows(arr: np.ndarray, order: np.ndarray | None = None) -> np.ndarray:
    """uint64 [count]: the xxh3_64 of each row's contiguous little-endian bytes; with `order`,
    of rows `order` only, in that order."""
    a = np.ascontiguousarray(arr)
    if a.dtype.byteorder == ">":
        a = a.byteswap().view(a.dtype.newbyteorder("<"))
    width = a.dtype.itemsize * int(np.prod(a.shape[1:]))  # not -1: a step may have no rows
    starts = np.arange(a.shape[0]) if order is None else order
    return hash_at(memoryview(a.reshape(-1).view(np.uint8)), row_slices(starts, width))
