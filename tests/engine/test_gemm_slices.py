"""gemm's cached K-slices and the CPU streams gemm and gemv share their work over give the
bits of the computation they replace: the weights sliced on every call, every partial and
every row on the caller's stream. The slices live on the op (gone with it) and are cut
again when its weights change."""
from __future__ import annotations

import gc
import math
import weakref

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from divergence.engine.kernels import linear as kernels, splits as cpu_split
from divergence.engine.kernels.linear import LinearOp

pytestmark = pytest.mark.blas  # fp32 bits are OpenBLAS kernels': every core (.ci/blas-cores)


def _bits(a: mx.array) -> np.ndarray:
    mx.eval(a)
    return np.array(a.view(mx.uint16 if a.dtype.size == 2 else mx.uint32))


def old_gemm(x: mx.array, op: LinearOp, splits: int) -> mx.array:
    """run_gemm as it was: the weights sliced on every call, everything on one stream."""
    mod = op.module
    group = getattr(mod, "group_size", 1) if op.quantized else 1
    chunk = math.ceil(op.k / splits / max(kernels.GEMM_MIN_CHUNK, group)) * max(kernels.GEMM_MIN_CHUNK, group)
    acc = None
    for k0 in range(0, op.k, chunk):
        k1 = min(op.k, k0 + chunk)
        xs = x[:, k0:k1]
        if not op.quantized:
            part = xs @ mod.weight[:, k0:k1].T
        else:
            pw, g = 32 // mod.bits, mod.group_size
            part = mx.quantized_matmul(xs, mod.weight[:, k0 // pw: k1 // pw], scales=mod.scales[:, k0 // g: k1 // g],
                                       biases=mod.biases[:, k0 // g: k1 // g] if "biases" in mod else None,
                                       transpose=True, group_size=g, bits=mod.bits)
        acc = part if acc is None else acc + part
    if not op.tied_embedding and "bias" in mod:
        acc = acc + mod.bias
    return acc


def old_gemv(x: mx.array, op: LinearOp) -> mx.array:
    return mx.concatenate([op.native(x[i: i + 1]) for i in range(x.shape[0])], axis=0)


def make_op(n: int, k: int, dtype, *, bias: bool, quantized: bool, tied: bool = False, seed: int = 0) -> LinearOp:
    if tied:
        mod = nn.Embedding(n, k)
        mod.weight = (mx.random.normal((n, k), key=mx.random.key(seed)) * 0.05).astype(dtype)
        if quantized:
            mod = nn.QuantizedEmbedding.from_embedding(mod, group_size=32, bits=4)
        return LinearOp.from_module("lm_head", mod, tied_embedding=True)
    mod = nn.Linear(k, n, bias=bias)
    mod.weight = (mx.random.normal((n, k), key=mx.random.key(seed)) * 0.05).astype(dtype)
    if bias:
        mod.bias = (mx.random.normal((n,), key=mx.random.key(seed + 1)) * 0.1).astype(dtype)
    if quantized:
        mod = nn.QuantizedLinear.from_linear(mod, group_size=32, bits=4)
    return LinearOp.from_module("gate_proj", mod)


@pytest.fixture(params=["one stream", "two streams"])
def streams(request):
    """No CPU split, or a 2-part one taken by every product (threshold 0); the process's own after."""
    saved, threshold = cpu_split._state.get("split", "unset"), cpu_split.MIN_MACS
    if request.param == "one stream":
        cpu_split.configure(None)
    else:
        cpu_split.configure(cpu_split.ColumnSplit(2, (mx.new_stream(mx.cpu),),
                                                  frozenset({mx.bfloat16, mx.float16, mx.float32})), min_macs=0)
    yield request.param
    cpu_split.configure(None, min_macs=threshold)
    if saved == "unset":
        cpu_split.forget()
    else:
        cpu_split.configure(saved)


CASES = [(mx.bfloat16, False, False, False), (mx.bfloat16, True, False, False), (mx.float16, False, False, False),
         (mx.float32, True, False, False), (mx.bfloat16, True, True, False), (mx.float16, False, True, False),
         (mx.bfloat16, False, False, True), (mx.bfloat16, False, True, True)]
IDS = [f"{d}{'+bias' if b else ''}{'-q4' if q else ''}{'-tied' if t else ''}" for d, b, q, t in CASES]


@pytest.mark.parametrize("dtype,bias,quantized,tied", CASES, ids=IDS)
def test_gemm_has_the_bits_of_slicing_every_call(streams, dtype, bias, quantized, tied):
    op = make_op(160, 352, dtype, bias=bias, quantized=quantized, tied=tied)
    for m in (1, 5, 8, 37):
        x = mx.random.normal((m, 352), key=mx.random.key(m)).astype(dtype)
        for splits in (2, 3, 8, kernels.gemm_splits(m, op.n, op.k, group=32 if quantized else 1)):
            assert np.array_equal(_bits(kernels.run_gemm(x, op, splits)), _bits(old_gemm(x, op, splits))), (m, splits)


@pytest.mark.parametrize("dtype,bias,quantized,tied", CASES, ids=IDS)
def test_gemv_has_the_bits_of_one_stream(streams, dtype, bias, quantized, tied):
    op = make_op(160, 352, dtype, bias=bias, quantized=quantized, tied=tied)
    for m in (1, 2, 3, 4, 7):
        x = mx.random.normal((m, 352), key=mx.random.key(m)).astype(dtype)
        assert np.array_equal(_bits(kernels.run_gemv(x, op)), _bits(old_gemv(x, op))), m


def test_slices_are_cut_once_and_again_for_new_weights():
    op = make_op(96, 256, mx.bfloat16, bias=False, quantized=False)
    chunk = kernels.gemm_chunk(op, 4)
    first = op.k_slices(chunk)
    assert op.k_slices(chunk) is first and len(first) == 4
    assert all(ops[0].shape == (chunk, 96) for _, _, ops in first)
    op.module.weight = op.module.weight * 2
    again = op.k_slices(chunk)
    assert again is not first
    x = mx.random.normal((6, 256), key=mx.random.key(1)).astype(mx.bfloat16)
    assert np.array_equal(_bits(kernels.run_gemm(x, op, 4)), _bits(old_gemm(x, op, 4)))


def test_slices_go_with_the_op():
    op = make_op(96, 256, mx.bfloat16, bias=False, quantized=False)
    kernels.run_gemm(mx.ones((6, 256), dtype=mx.bfloat16), op, 4)
    refs = [weakref.ref(ops[0]) for _, _, ops in op.k_slices(kernels.gemm_chunk(op, 4))]
    del op
    gc.collect()
    assert all(r() is None for r in refs)


@pytest.fixture
def fresh_proofs(monkeypatch):
    """Proofs in memory only, none made yet (a new process, DIVERGENCE_PROOF_CACHE=off)."""
    from divergence.engine.kernels import backend_proofs

    monkeypatch.setenv(backend_proofs.OFF_ENV, "off")
    monkeypatch.setattr(backend_proofs, "PROOFS", backend_proofs.BackendProofs())


@pytest.mark.parametrize("dtype,bias,quantized,tied", CASES, ids=IDS)
def test_gemv_and_batch_invariant_keep_their_definitions_bits(fresh_proofs, streams, dtype, bias, quantized, tied):
    """Where a proof lets them run as one native call, the bits are the definition's."""
    op = make_op(160, 352, dtype, bias=bias, quantized=quantized, tied=tied)
    for m in (1, 2, 3, 4, 7, 8, 9, 17):
        x = mx.random.normal((m, 352), key=mx.random.key(m + 100)).astype(dtype)
        assert np.array_equal(_bits(kernels.run_gemv(x, op)), _bits(kernels.gemv_rows(x, op))), m
        assert np.array_equal(_bits(kernels.run_batch_invariant(x, op)), _bits(kernels.tiled(x, op))), m


class _ShapeDependent(nn.Linear):
    """A backend whose product depends on how many rows the call has."""

    def __call__(self, x):
        return super().__call__(x) + x.shape[0]


def test_a_kernel_that_depends_on_m_keeps_its_definition(fresh_proofs):
    lin = _ShapeDependent(64, 32, bias=False)
    op = LinearOp.from_module("gate_proj", lin)
    x = mx.random.normal((3, 64), key=mx.random.key(5))
    assert not op.proved(kernels.GEMV, 3, x.dtype) and not op.proved(kernels.BATCH_INVARIANT, 3, x.dtype)
    assert np.array_equal(_bits(kernels.run_gemv(x, op)), _bits(old_gemv(x, op)))
    assert not np.array_equal(_bits(kernels.run_gemv(x, op)), _bits(op.native(x)))
    assert np.array_equal(_bits(kernels.run_batch_invariant(x, op)), _bits(kernels.tiled(x, op)))
    assert not np.array_equal(_bits(kernels.run_batch_invariant(x, op)), _bits(op.native(x)))


def test_bf16_rows_are_proved_on_the_cpu(fresh_proofs):
    """MLX's bf16 CPU matmul sums each output in one order whatever M: gemv and
    batch-invariant run as one native call there (the speed-up this proof is for)."""
    if mx.default_device() != mx.cpu:
        pytest.skip("CPU kernels")
    op = make_op(160, 352, mx.bfloat16, bias=False, quantized=False)
    assert all(op.proved(kernels.GEMV, m, mx.bfloat16) for m in (2, 3, 4))
    assert all(op.proved(kernels.BATCH_INVARIANT, m, mx.bfloat16) for m in (1, 5, 8, 9))

