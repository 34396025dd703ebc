"""hash_rows: xxh3_64 of each position's exact little-endian bytes."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import xxhash

from divergence.trace.hashing import hash_rows


def test_hash_rows_is_xxh3_of_each_rows_bytes():
    rng = np.random.default_rng(0)
    k = rng.integers(0, 2**16, (5, 2, 8), dtype=np.uint16)  # 5 positions x 2 kv heads x 8 dims, bf16 bits
    h = hash_rows(k)
    assert h.dtype == np.uint64 and h.shape == (5,)
    assert h.tolist() == [xxhash.xxh3_64_intdigest(k[i].tobytes()) for i in range(5)]
    assert np.array_equal(hash_rows(k.astype(">u2")), h)  # byte order of the input does not matter
    assert np.array_equal(hash_rows(np.asfortranarray(k)), h)  # nor its memory layout
    k2 = k.copy()
    k2[3, 1, 7] ^= 1  # one bit of one value
    assert (hash_rows(k2) != h).tolist() == [False, False, False, True, False]
    assert hash_rows(np.zeros((0, 4), np.float32)).shape == (0,)


def test_the_engine_can_import_it_without_h5py():
    code = "import sys, divergence.trace.hashing; assert 'h5py' not in sys.modules and 'mlx' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
