"""Probe rows under which another summation order shows in a linear op's output bits.

A proof that two calls give the same bits (backend_proofs) is only as good as its probe.
Random normal rows are a weak one wherever the output is narrower than the accumulator:
two fp32 sums in other orders differ in their last bits, and rounding both to bf16 (8
bits) hides that for almost every element (seed 002's q_proj: the probe called one class
what real hidden states split in two). A probe can refute, never prove; these rows make
refuting likely.

Each row aims at one output column n of the op's own weights. It holds pairs of inputs
that cancel exactly in that column (x1 * w[n, k1] = -x2 * w[n, k2]: weights whose
magnitudes differ by a power of two, inputs that are powers of two, so every product is
exact), at magnitudes spread over ~20 binades, and small terms elsewhere. The exact sum
of the column is the small terms' alone; the partial sums on the way hold the big pairs,
which absorb the small terms' low bits differently for every order in which they are
met. So in that column the result's leading bits follow the order of summation, and a
kernel that sums in another order (another split-K, another tile, GEMV vs GEMM) gives
other bits there even after rounding to bf16. Quantized ops sum each group as
scale * sum(x * q) + bias * sum(x) on some backends: their pairs are equal values inside
one group, which cancel in both terms.

Dense fp32 weights seldom hold two magnitudes a power of two apart: their rows are mostly
the small terms, and an fp32 output shows another order without help. Only the values are
adversarial: the shapes, dtypes and layouts, which decide the kernel
a backend picks, are the op's own.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

PAIRS = 24  # cancelling pairs per row
SMALL = 24  # small terms per row
SPAN = 26  # binades between the largest pair and the smallest term
BIG_SPAN = 6  # binades the pairs spread over
SMALL_GAP = 17  # binades between the largest pair and the largest small term


def revealing_rows(op, m: int, dtype, seed: int) -> mx.array:
    """[m, op.k] rows of `dtype` for `op`, row r aimed at one output column (see above)."""
    return aimed_rows(op, m, dtype, seed)[0]


def aimed_rows(op, m: int, dtype, seed: int) -> tuple[mx.array, np.ndarray]:
    """revealing_rows and the output column each row is aimed at."""
    rng = np.random.default_rng(seed)
    cols = rng.integers(0, op.n, size=m)
    w, ids = _weight_rows(op, cols)  # [m, K] float32: the values each product multiplies
    group = op.module.group_size if op.quantized else None
    # the largest term |x * w| a row holds: small enough that no column of an fp16 call
    # overflows (PAIRS * 2 terms), large enough to reach far above the small terms
    limit = 2.0 ** (9 if dtype == mx.float16 else 40)
    # in fp16 the largest weight of any column bounds the inputs (other columns do not cancel)
    wmax = _largest_weight(op) if dtype == mx.float16 else None
    x = np.zeros((m, op.k), np.float32)
    for r in range(m):
        x[r] = _row(w[r], None if ids is None else ids[r], group, limit, rng, wmax)
    return mx.array(x).astype(dtype), cols


def _largest_weight(op) -> float:
    """An upper bound of |w| over the whole op: its largest weight, or for a quantized op
    its largest |scale| * (2**bits - 1) + |bias| (one pass over the small arrays)."""
    mod = op.module
    if not op.quantized:
        return float(mx.abs(mod.weight).max().astype(mx.float32).item())
    bound = mx.abs(mod.scales).max().astype(mx.float32) * (2 ** mod.bits - 1)
    if "biases" in mod and mod.biases is not None:
        bound = bound + mx.abs(mod.biases).max().astype(mx.float32)
    return float(bound.item())


def _row(w: np.ndarray, ids: np.ndarray | None, group: int | None, limit: float, rng,
         wmax: float | None = None) -> np.ndarray:
    k = w.shape[0]
    x = np.zeros(k, np.float32)
    nz = np.flatnonzero(w)
    if nz.size < 2 or not np.isfinite(w).all():
        return rng.standard_normal(k).astype(np.float32)
    wmax = max(wmax or 0.0, float(np.abs(w[nz]).max()))
    top = int(np.floor(np.log2(limit / wmax)))  # x = 2**top keeps |x * w| <= limit
    used = np.zeros(k, bool)
    for k1, k2, shift in _pairs(w, ids, nz, group, rng):
        if used[k1] or used[k2]:
            continue
        e = int(rng.integers(top - BIG_SPAN, top + 1))
        # x1 * w1 = -x2 * w2, exactly: |w1| = 2**shift * |w2|
        x[k1] = 2.0 ** e
        x[k2] = -np.sign(w[k1]) * np.sign(w[k2]) * 2.0 ** (e + shift)
        used[k1] = used[k2] = True
        if used.sum() >= 2 * PAIRS:
            break
    free = np.flatnonzero(~used & (w != 0))
    small = rng.choice(free, size=min(SMALL, free.size), replace=False)
    x[small] = rng.choice([-1.0, 1.0], size=small.size) * 2.0 ** rng.integers(top - SPAN, top - SMALL_GAP, size=small.size)
    return x


def _pairs(w: np.ndarray, ids: np.ndarray | None, nz: np.ndarray, group: int | None, rng):
    """(k1, k2, shift) with |w[k1]| = 2**shift * |w[k2]|, in random order. For a quantized op
    positions of one group holding the same stored value `ids` (shift 0: they cancel in its
    sum(x * q) and in its sum(x) alike)."""
    mant, expo = np.frexp(np.abs(w[nz]))
    if group:
        order = np.lexsort((ids[nz], nz // group))
        same = lambda a, b: ids[nz[a]] == ids[nz[b]] and nz[a] // group == nz[b] // group  # noqa: E731
    else:
        order = np.argsort(mant, kind="stable")
        same = lambda a, b: mant[a] == mant[b]  # noqa: E731
    out = []
    for a, b in zip(order[:-1], order[1:]):
        if same(a, b):
            shift = 0 if group else int(expo[a] - expo[b])
            if abs(shift) <= 4:
                out.append((int(nz[a]), int(nz[b]), shift))
    rng.shuffle(out)
    return out


def _weight_rows(op, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """The op's weights at output columns `cols` as the products read them, float32 [len, K],
    and for an affine-quantized op the stored integers q beside them (else None)."""
    mod = op.module
    idx = mx.array(cols.astype(np.int32))
    if not op.quantized:
        return np.array(mod.weight[idx].astype(mx.float32)), None
    mode = getattr(mod, "mode", "affine")
    packed, scales = mod.weight[idx], mod.scales[idx]
    biases = mod.biases[idx] if "biases" in mod else None
    kw = dict(group_size=mod.group_size, bits=mod.bits, mode=mode)
    values = np.array(mx.dequantize(packed, scales, biases, **kw).astype(mx.float32))
    if mode != "affine" or biases is None:
        return values, values  # equal values of one group still cancel in a plain sum
    q = mx.dequantize(packed, mx.ones_like(scales), mx.zeros_like(biases), **kw)
    return values, np.array(q.astype(mx.float32))
