"""The rows that proofs probe with reveal a reordered sum that random rows hide (order_probe)."""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from divergence.engine.kernels import backend_proofs, linear as kernels
from divergence.engine.kernels.linear import LinearOp
from divergence.engine.kernels.order_probe import aimed_rows

from test_gemm_slices import make_op  # noqa: F401  (tests/engine is on sys.path: rootdir conftest)


@pytest.fixture
def fresh_proofs(monkeypatch):
    monkeypatch.setenv(backend_proofs.OFF_ENV, "off")
    monkeypatch.setattr(backend_proofs, "PROOFS", backend_proofs.BackendProofs())


def _f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).astype(np.float64)


@pytest.mark.parametrize("dtype,quantized", [(mx.bfloat16, False), (mx.float16, False), (mx.bfloat16, True),
                                             (mx.float16, True), (mx.float32, True)],
                         ids=["bf16", "fp16", "bf16-4bit", "fp16-4bit", "fp32-4bit"])
def test_each_row_cancels_to_its_small_terms_in_its_column(dtype, quantized):
    """Row r's pairs cancel exactly in its column: the exact sum there is the small terms'
    alone, tens of binades below the largest product (so the order shows), and nothing
    overflows the output dtype. (Dense fp32 weights seldom hold two magnitudes a power of two
    apart: their rows are mostly small terms, and an fp32 output shows a reordering anyway.)"""
    op = make_op(192, 384, dtype, bias=False, quantized=quantized)
    w = _f64(mx.dequantize(op.module.weight, op.module.scales, op.module.biases, group_size=32, bits=4)
             if quantized else op.module.weight)
    x, cols = aimed_rows(op, 6, dtype, seed=3)
    xs = _f64(x)
    paired = 0
    for r, n in enumerate(cols):
        terms = xs[r] * w[n]
        big = np.abs(terms).max()
        assert abs(terms.sum()) < big * 2.0 ** -12, (r, terms.sum(), big)
        paired += int((np.abs(terms) > big * 2.0 ** -8).sum())
    assert paired >= 6 * 8  # pairs were found in every column
    assert np.isfinite(_f64(op.native(x))).all()


class _SumsInHalves(nn.Linear):
    """A backend whose calls of more than one row sum each output's fp32 products in two
    halves of K, and one row's in one pass, rounding to the output dtype either way: its rows
    differ from a row alone only by the order of an fp32 sum (MLX's own reductions, so the
    same on every CPU and BLAS). Not split over CPU streams: every call is this one."""

    splittable = False

    def __call__(self, x):
        prod = x.astype(mx.float32)[:, None, :] * self.weight.astype(mx.float32)[None]
        if x.shape[0] == 1:
            return prod.sum(axis=-1).astype(x.dtype)
        h = 160
        return (prod[..., :h].sum(axis=-1) + prod[..., h:].sum(axis=-1)).astype(x.dtype)


def test_a_reordered_fp32_sum_under_bf16_is_refuted(fresh_proofs):
    lin = _SumsInHalves(352, 160, bias=False)
    lin.weight = (mx.random.normal((160, 352), key=mx.random.key(1)) * 0.05).astype(mx.bfloat16)
    op = LinearOp.from_module("gate_proj", lin)
    ms = (2, 3, 4, 5, 6, 7)
    fooled = []
    for m in ms:  # what a proof on random rows alone concluded (PROOF_METHOD 1)
        x = mx.random.normal((m, 352), key=mx.random.key(13)).astype(mx.bfloat16)
        a, b = kernels.gemv_rows(x, op), op.native(x)
        fooled.append(bool(np.array_equal(np.array(a.view(mx.uint16)), np.array(b.view(mx.uint16)))))
    assert any(fooled), "random rows caught every reordering here: the case no longer shows the weakness"
    assert not any(op.proved(kernels.GEMV, m, mx.bfloat16) for m in ms)
    for m in ms:  # so gemv runs as defined, each row its own one-row call
        x = mx.random.normal((m, 352), key=mx.random.key(m)).astype(mx.bfloat16)
        assert np.array_equal(np.array(kernels.run_gemv(x, op).view(mx.uint16)),
                              np.array(kernels.gemv_rows(x, op).view(mx.uint16)))


def test_fp16_rows_bound_by_every_column():
    """In fp16 the columns a row is not aimed at do not cancel: a few much larger weights
    elsewhere must not overflow the call."""
    op = make_op(192, 384, mx.float16, bias=False, quantized=False)
    op.module.weight = op.module.weight * mx.array(np.where(np.arange(192) < 4, 64.0, 1.0)[:, None], dtype=mx.float16)
    for seed in range(4):
        x, cols = aimed_rows(op, 5, mx.float16, seed)
        assert not np.isin(cols, np.arange(4)).all()
        assert np.isfinite(_f64(op.native(x))).all(), seed
