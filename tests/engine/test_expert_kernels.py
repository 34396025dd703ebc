"""The experts op under every policy against a float64 numpy reference, and the
properties that make the kernels what they claim: gemm reorders the sum (bits
differ from gemv), batch-invariant rows don't depend on the other rows."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from divergence.core.policy import KernelPolicy
from divergence.engine.kernels.dispatch import KernelDispatcher
from divergence.engine.kernels.experts import run_experts
from divergence.engine.model.forward import PackedForward

MOE = dict(hidden_size=64, num_layers=1, num_experts=8, experts_per_token=2, intermediate_size=96)
POLICIES = ["native", "gemv", "gemm", "batch-invariant", "threshold:1", "threshold:3"]


def _dense(switch) -> np.ndarray:
    if hasattr(switch, "scales"):
        # scales / biases in float32: dequantizing in bf16 would round the weights themselves
        w = mx.dequantize(switch.weight, switch.scales.astype(mx.float32), switch["biases"].astype(mx.float32),
                          group_size=switch.group_size, bits=switch.bits)
    else:
        w = switch.weight
    return np.array(w.astype(mx.float32)).astype(np.float64)


def reference(block, x: np.ndarray, inds: np.ndarray) -> np.ndarray:
    """float64: down(silu(gate(x)) * up(x)) per (token, chosen expert)."""
    sw = block.experts.module
    wu, wg, wd = _dense(sw.up_proj), _dense(sw.gate_proj), _dense(sw.down_proj)
    out = np.zeros(inds.shape + (x.shape[1],))
    for t in range(x.shape[0]):
        for j, e in enumerate(inds[t]):
            g, u = wg[e] @ x[t], wu[e] @ x[t]
            out[t, j] = wd[e] @ (g / (1 + np.exp(-g)) * u)
    return out


def setup(random_model, fmt, rows=24):
    kw = dict(dtype="float32") if fmt == "float32" else dict(dtype="bfloat16", quantize_bits=4)
    loaded = random_model("qwen3_moe", **MOE, **kw)
    block = PackedForward(loaded).moe[0]
    dt = loaded.model.model.norm.weight.dtype
    x = mx.random.normal((rows, 64), key=mx.random.key(3)).astype(dt)
    inds, _, _ = block.route(block.gate.native(x))
    return block, x, inds


def run(block, x, inds, policy):
    recs = []
    d = KernelDispatcher(KernelPolicy.parse(policy), "target", recs.append)
    d.begin_step(0)
    y = run_experts(x, inds, block.experts, d, 0)
    mx.eval(y)
    return y, recs


@pytest.mark.parametrize("fmt", ["float32", "4bit"])
@pytest.mark.parametrize("policy", POLICIES)
def test_experts_match_float64_reference(random_model, fmt, policy):
    block, x, inds = setup(random_model, fmt)
    y, recs = run(block, x, inds, policy)
    ref = reference(block, np.array(x.astype(mx.float32)).astype(np.float64), np.array(inds))
    got = np.array(y.astype(mx.float32)).astype(np.float64)
    if fmt == "float32":
        assert np.abs(got - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())
    else:  # mlx's CPU bf16 quantized matmul alone is ~1% off float64 (bf16 sums): a relative bound
        assert np.linalg.norm(got - ref) <= 4e-2 * np.linalg.norm(ref)
    # the bound can fail: the right weights on the wrong experts are far outside it
    wrong = reference(block, np.array(x.astype(mx.float32)).astype(np.float64), (np.array(inds) + 1) % 8)
    assert np.linalg.norm(got - wrong) > 0.5 * np.linalg.norm(ref)
    # one record per expert that received rows; they add up to every (token, expert) pair
    counts = np.bincount(np.array(inds).reshape(-1), minlength=8)
    assert {r.expert: r.rows for r in recs} == {e: int(c) for e, c in enumerate(counts) if c}
    assert all(r.op == "experts" and (r.m, r.n, r.k) == (r.rows, 96, 64) for r in recs)
    if policy.startswith("threshold"):
        n = int(policy.split(":")[1])
        assert all(r.kernel == ("gemv" if r.rows <= n else "gemm") for r in recs)


def test_gemm_reorders_the_sum(random_model):
    block, x, inds = setup(random_model, "float32")
    a, _ = run(block, x, inds, "gemv")
    b, recs = run(block, x, inds, "gemm")
    assert all(r.splits >= 2 for r in recs)
    assert not np.array_equal(np.array(a).view(np.uint32), np.array(b).view(np.uint32))


@pytest.mark.parametrize("fmt", ["float32", "4bit"])
def test_batch_invariant_rows_do_not_depend_on_the_batch(random_model, fmt):
    block, x, inds = setup(random_model, fmt)
    whole, _ = run(block, x, inds, "batch-invariant")
    for lo, hi in ((0, 1), (3, 5), (5, 19)):
        part, _ = run(block, x[lo:hi], inds[lo:hi], "batch-invariant")
        assert np.array_equal(_bits(part), _bits(whole[lo:hi]))


def _bits(a):
    return np.array(a.view(mx.uint16 if a.dtype.size == 2 else mx.uint32))
