"""KV hashing: xxhash's C xxh3 row by row (divergence.core.hashing.hash_rows) vs xxh3
written as numpy operations over all rows at once, on a step's K/V rows.

    python bench/bench_hashing.py            # fixture and 0.5B-shaped steps, 7 reps
    python bench/bench_hashing.py --quick    # 3 reps, fewer sizes

Both give the same hashes (checked on every size before timing). Rows are one position's
K or V over all kv heads: 2 x 64 values, 512 bytes in fp32 and 256 in bf16 for both models.
Writes bench/results/hashing.json (--quick: a temp dir, unless --out).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import common as C  # noqa: I001  (first: sys.path + BLAS before mlx)
from divergence.core.hashing import hash_rows

# xxh3's constants (xxhash.h: XXH_PRIME*, XXH3_kSecret, the default secret of seed 0)
_P32_1, _P32_2, _P32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
_P64_1, _P64_2, _P64_3, _P64_4, _P64_5 = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                                          0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5)
_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")
_STRIPE = 64
_STRIPES_PER_BLOCK = (len(_SECRET) - _STRIPE) // 8  # 16: a block is 1,024 bytes
_MIDSIZE_MAX = 240  # longer inputs take the long path


def _words(offset: int, n: int = 8) -> np.ndarray:
    """n little-endian 64-bit words of the secret from byte `offset` (any alignment)."""
    return np.frombuffer(_SECRET, dtype="<u8", count=n, offset=offset).astype(np.uint64)


_U = np.uint64
_M32 = _U(0xFFFFFFFF)
_SWAP = np.array([1, 0, 3, 2, 5, 4, 7, 6])  # accumulate adds lane i's data into lane i ^ 1
_STRIPE_KEYS = np.stack([_words(8 * s) for s in range(_STRIPES_PER_BLOCK)])  # stripe s reads secret + 8 s
_SCRAMBLE_KEY = _words(len(_SECRET) - _STRIPE)
_LAST_KEY = _words(len(_SECRET) - _STRIPE - 7)  # XXH_SECRET_LASTACC_START
_MERGE_KEY = _words(11)  # XXH_SECRET_MERGEACCS_START
_INIT_ACC = np.array([_P32_3, _P64_1, _P64_2, _P64_3, _P64_4, _P32_2, _P64_5, _P32_1], dtype=np.uint64)


def _accumulate(acc: np.ndarray, data: np.ndarray, keys: np.ndarray) -> None:
    """acc [R, 8] += the stripes data [R, S, 8] under keys [S, 8]. Within a block xxh3 only
    adds (mod 2^64), so all stripes are summed at once."""
    dk = data ^ keys
    acc += ((dk & _M32) * (dk >> _U(32))).sum(axis=1, dtype=np.uint64)
    acc += data.sum(axis=1, dtype=np.uint64)[:, _SWAP]


def _mul128_fold64(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Low 64 bits xor high 64 bits of the 128-bit products a * b (xxhash's portable form)."""
    s32 = _U(32)
    a_lo, a_hi, b_lo, b_hi = a & _M32, a >> s32, b & _M32, b >> s32
    lo_lo, hi_lo, lo_hi, hi_hi = a_lo * b_lo, a_hi * b_lo, a_lo * b_hi, a_hi * b_hi
    cross = (lo_lo >> s32) + (hi_lo & _M32) + lo_hi
    upper = (hi_lo >> s32) + (cross >> s32) + hi_hi
    lower = (cross << s32) | (lo_lo & _M32)
    return lower ^ upper


def _hash_long(rows: np.ndarray) -> np.ndarray:
    """xxh3_64 (seed 0) of each row of rows [R, L] uint8, L > 240."""
    r, n = rows.shape
    acc = np.broadcast_to(_INIT_ACC, (r, 8)).copy()
    block = _STRIPE * _STRIPES_PER_BLOCK
    blocks = (n - 1) // block
    for i in range(blocks):
        data = np.ascontiguousarray(rows[:, i * block:(i + 1) * block]).view("<u8").reshape(r, -1, 8)
        _accumulate(acc, data.astype(np.uint64, copy=False), _STRIPE_KEYS)
        acc ^= acc >> _U(47)
        acc ^= _SCRAMBLE_KEY
        acc *= _U(_P32_1)
    stripes = ((n - 1) - block * blocks) // _STRIPE
    if stripes:
        lo = blocks * block
        data = np.ascontiguousarray(rows[:, lo:lo + stripes * _STRIPE]).view("<u8").reshape(r, stripes, 8)
        _accumulate(acc, data.astype(np.uint64, copy=False), _STRIPE_KEYS[:stripes])
    last = np.ascontiguousarray(rows[:, n - _STRIPE:]).view("<u8").reshape(r, 1, 8)
    _accumulate(acc, last.astype(np.uint64, copy=False), _LAST_KEY[None])
    x = acc ^ _MERGE_KEY
    h = np.full(r, _U((n * _P64_1) & 0xFFFFFFFFFFFFFFFF), dtype=np.uint64)
    for i in range(4):
        h += _mul128_fold64(x[:, 2 * i], x[:, 2 * i + 1])
    h ^= h >> _U(37)
    h *= _U(0x165667919E3779F9)
    h ^= h >> _U(32)
    return h



def hash_rows_numpy(rows: np.ndarray) -> np.ndarray:
    """xxh3_64 of each row of rows [R, L] uint8 (L > 240: xxh3's long path)."""
    assert rows.shape[1] > _MIDSIZE_MAX
    with np.errstate(over="ignore"):  # uint64 arithmetic is meant to wrap
        return _hash_long(rows)


# (what, rows per step): a step's K and V rows, layers x positions x 2
STEPS = [("fixture decode B=8", 4 * 8 * 2), ("fixture prefill 8x16", 4 * 128 * 2),
         ("0.5B decode B=8", 24 * 8 * 2), ("0.5B prefill 8x64", 24 * 512 * 2)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    reps = 3 if a.quick else max(5, a.reps)
    rng = np.random.default_rng(0)
    results, rows_out = [], []
    for what, n in STEPS[:2] if a.quick else STEPS:
        for width in (256, 512):
            rows = rng.integers(0, 256, size=(n, width), dtype=np.uint8)
            assert np.array_equal(hash_rows(rows), hash_rows_numpy(rows)), "numpy xxh3 differs from xxhash"
            ratios, c_us, np_us = [], [], []
            for rep in range(reps):  # paired, the order alternating
                pair = {}
                for name, fn in ((("c", hash_rows), ("numpy", hash_rows_numpy))[:: 1 if rep % 2 else -1]):
                    t0 = time.perf_counter()
                    fn(rows)
                    pair[name] = time.perf_counter() - t0
                c_us.append(pair["c"] * 1e6)
                np_us.append(pair["numpy"] * 1e6)
                ratios.append(pair["numpy"] / pair["c"])
            r = {"step": what, "rows": n, "row_bytes": width, "c_us": C.summary(c_us), "numpy_us": C.summary(np_us),
                 "numpy_over_c": C.med(ratios)}
            results.append(r)
            rows_out.append([what, n, width, C.fmt(r["c_us"]["median"], 0), C.fmt(r["numpy_us"]["median"], 0),
                             C.fmt(r["numpy_over_c"])])
    txt = C.table(rows_out, ["step", "rows", "row bytes", "xxhash C us", "numpy us", "numpy / C"])
    print("\n" + txt)
    C.write_json(C.out_path("hashing", a.quick, a.out), {"meta": C.meta(a), "results": results,
                                                          "table": txt.splitlines()})


if __name__ == "__main__":
    main()
