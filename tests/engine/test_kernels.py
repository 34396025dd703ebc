"""Kernel variants against a float64 numpy reference, and the properties that make
them useful: gemm really reorders the sum; batch-invariant really is."""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from divergence.engine.kernels import linear as kernels
from divergence.engine.kernels.dispatch import KernelDispatcher, KernelPolicy
from divergence.engine.kernels.linear import LinearOp
from divergence.errors import PolicyError

# Unit roundoff of each compute dtype; a K-term dot product in that dtype may be
# off by about sqrt(K) * u * sum|x_i w_i| (random-walk bound), and split-K adds
# one rounding per partial sum.
UNIT_ROUNDOFF = {mx.float32: 2.0**-24, mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8}


def make_op(n, k, dtype, *, bias=False, quantized=False, seed=0):
    lin = nn.Linear(k, n, bias=bias)
    key = mx.random.key(seed)
    lin.weight = (mx.random.normal((n, k), key=key) * 0.05).astype(dtype)
    if bias:
        lin.bias = (mx.random.normal((n,), key=mx.random.key(seed + 1)) * 0.1).astype(dtype)
    if quantized:
        lin = nn.QuantizedLinear.from_linear(lin, group_size=32, bits=4)
    return LinearOp.from_module("test", lin)


def reference(x, op):
    """float64 numpy product with the (dequantized) weights the op really holds."""
    m = op.module
    if op.quantized:
        w = mx.dequantize(m.weight, m.scales, m.biases, group_size=m.group_size, bits=m.bits)
    else:
        w = m.weight
    ref = np.asarray(x.astype(mx.float32), np.float64) @ np.asarray(w.astype(mx.float32), np.float64).T
    if "bias" in m:
        ref += np.asarray(m.bias.astype(mx.float32), np.float64)
    xa = np.abs(np.asarray(x.astype(mx.float32), np.float64))
    scale = xa @ np.abs(np.asarray(w.astype(mx.float32), np.float64)).T
    return ref, scale


def tolerance(dtype, k, scale, splits=1):
    u = UNIT_ROUNDOFF[dtype]
    # products + accumulation (sqrt K random walk, x4 margin), output rounding, split-K roundings
    return (4 * np.sqrt(k) * u + (2 + splits) * u) * scale + 1e-30


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("kernel", ["gemv", "gemm", "batch-invariant"])
@pytest.mark.parametrize("quantized", [False, True])
def test_kernel_matches_float64(dtype, kernel, quantized):
    op = make_op(96, 256, dtype, bias=not quantized, quantized=quantized)
    x = (mx.random.normal((37, 256), key=mx.random.key(7))).astype(dtype)
    disp = KernelDispatcher(KernelPolicy.parse(kernel), "target")
    y = disp(x, op, 0)
    mx.eval(y)
    ref, scale = reference(x, op)
    got = np.asarray(y.astype(mx.float32), np.float64)
    splits = kernels.gemm_splits(37, 96, 256, group=32 if quantized else 1) if kernel == "gemm" else 1
    tol = tolerance(dtype, 256, scale, splits)
    assert got.shape == ref.shape
    assert np.all(np.abs(got - ref) <= tol), float(np.max(np.abs(got - ref) / tol))


def _bits(a):
    return np.asarray(a.view(mx.uint16 if a.dtype.size == 2 else mx.uint32))


@pytest.mark.parametrize("quantized", [False, True])
def test_gemm_reorders_the_sum_in_bf16(quantized):
    op = make_op(256, 256, mx.bfloat16, quantized=quantized)
    x = mx.random.normal((124, 256), key=mx.random.key(3)).astype(mx.bfloat16)
    gemv = KernelDispatcher(KernelPolicy.parse("gemv"), "target")
    gemm = KernelDispatcher(KernelPolicy.parse("gemm"), "target")
    for m in (1, 124):
        a, b = gemv(x[:m], op, 0), gemm(x[:m], op, 0)
        mx.eval(a, b)
        rows_differ = (_bits(a) != _bits(b)).any(axis=1)
        assert rows_differ.any(), f"gemm at M={m} is bitwise gemv on every row: it does not reorder the sum"


def test_gemm_splits_depend_on_shape():
    assert kernels.gemm_splits(1, 256, 4096) > kernels.gemm_splits(1024, 4096, 4096)
    assert kernels.gemm_splits(1, 64, 64) >= 1
    for m in (1, 4, 124, 4096):
        assert kernels.gemm_splits(m, 896, 896, group=64) * 64 <= 896


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_batch_invariant_rows_do_not_depend_on_row_count(dtype):
    op = make_op(128, 192, dtype)
    x = mx.random.normal((40, 192), key=mx.random.key(5)).astype(dtype)
    disp = KernelDispatcher(KernelPolicy.parse("batch-invariant"), "target")
    full = _bits(disp(x, op, 0))
    for m in (1, 2, 3, 7, 8, 9, 17, 33):
        part = _bits(disp(x[:m], op, 0))
        assert np.array_equal(part, full[:m]), f"row bits changed at M={m}"
    # and the first row alone equals itself anywhere in the batch
    for i in (5, 20, 39):
        assert np.array_equal(_bits(disp(x[i : i + 1], op, 0))[0], full[i])


def test_threshold_policy_and_events():
    events = []
    op = make_op(32, 64, mx.bfloat16)
    disp = KernelDispatcher(KernelPolicy.parse("threshold:4"), "target", events.append)
    disp.begin_step(3)
    disp(mx.zeros((4, 64), mx.bfloat16), op, 1)
    disp(mx.zeros((5, 64), mx.bfloat16), op, 1)
    assert [(e.step, e.layer, e.rows, e.kernel) for e in events] == [(3, 1, 4, "gemv"), (3, 1, 5, "gemm")]
    assert events[1].splits >= 2 and (events[1].m, events[1].n, events[1].k) == (5, 32, 64)


def test_forced_policy_applies_to_its_step_only():
    events = []
    op = make_op(32, 64, mx.bfloat16)
    disp = KernelDispatcher(KernelPolicy.parse("threshold:4"), "target", events.append)
    disp.forced = {2: KernelPolicy.parse("gemm:2")}
    for step in (1, 2, 3):
        disp.begin_step(step)
        disp(mx.zeros((1, 64), mx.bfloat16), op, 0)
    assert [(e.kernel, e.splits) for e in events] == [("gemv", 1), ("gemm", 2), ("gemv", 1)]


@pytest.mark.parametrize("bad", ["", "fast", "threshold:", "threshold:0", "threshold:x", "gemm:0"])
def test_bad_policy_is_a_typed_error(bad):
    with pytest.raises(PolicyError):
        KernelPolicy.parse(bad)
