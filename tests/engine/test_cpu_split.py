"""A product split by output columns across CPU streams has the unsplit call's bits.

The engine splits bf16 / fp16 / quantized products on the CPU (engine/kernels/splits.py)
because MLX runs those kernels on one thread. That is only allowed because every
output element's sum is the same whatever N is; these tests check it on every kind
of product the forward makes, then check a whole engine run with every product
split still equals mlx-lm's own model bit for bit.
"""
from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from divergence.engine.kernels import splits as cpu_split
from divergence.engine.kernels.linear import LinearOp

pytestmark = [pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the split runs on the CPU only"),
              pytest.mark.blas]  # fp32 bits are OpenBLAS kernels': every core (.ci/blas-cores)


def _bits(a: mx.array) -> np.ndarray:
    a = np.array(a.astype(mx.float32))
    return a.view(np.uint32)


def _split(parts: int) -> cpu_split.ColumnSplit:
    return cpu_split.ColumnSplit(parts, tuple(mx.new_stream(mx.cpu) for _ in range(parts - 1)),
                                 frozenset({mx.bfloat16, mx.float16, mx.float32}))


@pytest.fixture
def configure():
    """cpu_split.configure for one test; the process's own split and threshold back after."""
    saved, threshold = cpu_split._state.get("split", "unset"), cpu_split.MIN_MACS
    yield cpu_split.configure
    cpu_split.configure(None, min_macs=threshold)
    if saved == "unset":
        cpu_split.forget()
    else:
        cpu_split.configure(saved)


def _modules(dtype, n: int, k: int):
    mx.random.seed(n + k)
    plain = nn.Linear(k, n, bias=False)
    biased = nn.Linear(k, n, bias=True)
    table = nn.Embedding(n, k)
    for m in (plain, biased, table):
        m.set_dtype(dtype)
    out = {"linear": (plain, False), "linear+bias": (biased, False), "tied head": (table, True)}
    if dtype != mx.float32:
        q = nn.Linear(k, n, bias=True)
        q.set_dtype(dtype)
        out["4-bit+bias"] = (nn.QuantizedLinear.from_linear(q, group_size=32, bits=4), False)
        qt = nn.Embedding(n, k)
        qt.set_dtype(dtype)
        out["4-bit tied head"] = (nn.QuantizedEmbedding.from_embedding(qt, group_size=32, bits=4), True)
    return out


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("m", [1, 3, 8, 37])
def test_split_equals_unsplit_bitwise(dtype, m):
    n, k = 1000, 256  # N not a multiple of the part alignment: uneven last part
    x = mx.random.normal((m, k)).astype(dtype)
    for name, (module, tied) in _modules(dtype, n, k).items():
        whole = module.as_linear(x) if tied else module(x)
        for parts in (2, 3):
            got = cpu_split.linear(x, module, tied, _split(parts))
            assert got.dtype == whole.dtype and got.shape == whole.shape, name
            assert np.array_equal(_bits(got), _bits(whole)), (name, m, parts)


def test_linear_op_takes_the_split(monkeypatch, configure):
    """LinearOp.native splits exactly the products the rule says (and fp32 under OpenBLAS not)."""
    calls = []
    real = cpu_split.linear
    configure(cpu_split.ColumnSplit(2, (mx.new_stream(mx.cpu),), frozenset({mx.bfloat16})))
    monkeypatch.setattr(cpu_split, "linear", lambda *a: calls.append(a[0].shape) or real(*a))
    big = nn.Linear(512, 1024, bias=False)
    big.set_dtype(mx.bfloat16)
    op = LinearOp.from_module("q_proj", big)
    op.native(mx.ones((8, 512), mx.bfloat16))
    assert calls == [(8, 512)]
    op.native(mx.ones((1, 512), mx.bfloat16))  # 1 x 1024 x 512 = 2^19 multiply-adds
    assert len(calls) == 2
    small = nn.Linear(64, 64, bias=False)
    small.set_dtype(mx.bfloat16)
    LinearOp.from_module("q_proj", small).native(mx.ones((8, 64), mx.bfloat16))  # 2^15 multiply-adds
    big32 = nn.Linear(512, 1024, bias=False)
    LinearOp.from_module("q_proj", big32).native(mx.ones((8, 512)))
    assert len(calls) == 2


@pytest.mark.parametrize("which", ["bf16", "4-bit"])
def test_engine_with_every_product_split_equals_mlx_lm(monkeypatch, configure, target, target_4bit, prompts, which):
    """The whole forward with every product split (the threshold at 0): tokens and top-k
    logits equal mlx-lm's model on its own KVCache (generate_step's calls), bit for bit."""
    from divergence.core.request import Request
    from divergence.engine.engine import Engine
    from tests.engine.test_reference_logits import mlx_lm_logits

    calls = []
    real = cpu_split.linear
    configure(_split(3), min_macs=0)
    monkeypatch.setattr(cpu_split, "linear", lambda *a: calls.append(1) or real(*a))
    loaded = target if which == "bf16" else target_4bit
    eng = Engine(loaded, policy="native", stop_at_eos=False, top_k=8)
    reqs = [Request(f"r{i}", tuple(loaded.encode(p)), max_tokens=10) for i, p in enumerate(prompts[:2])]
    res = eng.run(reqs, "concurrent")
    assert calls, "no product was split"
    configure(None)  # the reference runs unsplit (mlx-lm's modules do not split anyway)
    for r in reqs:
        out = res.outputs[r.id]
        ref = mlx_lm_logits(loaded.model, list(r.prompt_tokens), 10, split_last=True)
        assert out.tokens == ref.tokens, r.id
        for i, (ids, vals) in enumerate(zip(out.topk_ids, out.topk_logits)):
            vals = np.asarray(vals, np.float32)
            assert np.array_equal(ref[i][np.asarray(ids)].view(np.uint32), vals.view(np.uint32)), (r.id, i)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", [1, 5, 37])
def test_an_expert_splits_like_its_own_call(bias, m):
    """An MoE expert (ExpertLinear: one expert of a SwitchGLU, as the grouped expert kernels
    run it) computes its own column parts: the same bits as its whole call."""
    from mlx_lm.models.switch_layers import SwitchGLU

    from divergence.engine.kernels.experts import ExpertWeights

    mx.random.seed(3)
    glu = SwitchGLU(256, 1000, 4, bias=bias)
    glu.set_dtype(mx.bfloat16)
    x = mx.random.normal((m, 256)).astype(mx.bfloat16)
    for op in ExpertWeights(glu).ops(2)[:2]:  # up and gate: [m, 256] -> [m, 1000]
        assert op.splittable
        whole = op.module(x)
        for parts in (2, 3):
            assert np.array_equal(_bits(cpu_split.linear(x, op.module, False, _split(parts))), _bits(whole))


def test_a_quantized_expert_is_not_split(monkeypatch, configure):
    """Its own op is the switch layer's gather_qmm, not the quantized_matmul a split runs."""
    from mlx_lm.models.switch_layers import SwitchGLU

    from divergence.engine.kernels.experts import ExpertWeights

    glu = SwitchGLU(256, 1024, 4)
    glu.set_dtype(mx.bfloat16)
    nn.quantize(glu, group_size=64, bits=4)
    calls = []
    configure(_split(2), min_macs=0)
    monkeypatch.setattr(cpu_split, "linear", lambda *a: calls.append(1))
    up = ExpertWeights(glu).ops(1)[0]
    assert not up.splittable
    x = mx.random.normal((8, 256)).astype(mx.bfloat16)
    assert np.array_equal(_bits(up.native(x)), _bits(up.module(x))) and not calls


def test_bf16_moe_with_split_experts_runs_every_schedule(configure, random_model, prompts):
    """Regression: a bf16 MoE model on the CPU (grouped experts: no bf16 gather_mm there) with
    expert products big enough to split crashed (the split indexed the expert like an
    mlx.nn module). Every product split now; serial, concurrent and warm agree."""
    from divergence.core.request import Request
    from divergence.engine.engine import Engine

    loaded = random_model("qwen3_moe", hidden_size=64, num_layers=2, num_experts=8, experts_per_token=2,
                          dtype="bfloat16")
    configure(_split(2), min_macs=0)
    eng = Engine(loaded, policy="native", stop_at_eos=False)
    reqs = [Request(f"r{i}", tuple(loaded.encode(p)), max_tokens=6) for i, p in enumerate(prompts[:3])]
    runs = {s: eng.run(reqs, s) for s in ("serial", "concurrent", "warm")}
    toks = {s: {r.id: res.outputs[r.id].tokens for r in reqs} for s, res in runs.items()}
    assert all(len(t) == 6 for t in toks["serial"].values())
    assert toks["serial"] == toks["concurrent"] == toks["warm"]


_REFERENCE_BLAS = """
import mlx.core as mx, mlx.nn as nn, numpy as np
from divergence.engine.kernels import splits as cpu_split
s = cpu_split.process_split()
assert s is not None and mx.float32 in s.dtypes, s
for m in (1, 5, 16):
    lin = nn.Linear(384, 1000, bias=True)
    x = mx.random.normal((m, 384))
    a, b = np.array(lin(x)), np.array(cpu_split.linear(x, lin, False, s))
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), m
print("ok")
"""


def test_reference_blas_fp32_is_split_and_bitwise():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one usable core: the split is off")
    env = dict(os.environ, DIVERGENCE_BLAS="reference")
    env.pop(cpu_split.ENV, None)
    out = subprocess.run([sys.executable, "-c", _REFERENCE_BLAS], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_the_fast_flag_follows_every_decision(configure):
    """LinearOp.native asks split_for only while MAY_SPLIT: it must never say False while a
    split is set or the process is still undecided (the split would stay off for good)."""
    configure(None)
    assert not cpu_split.MAY_SPLIT
    configure(_split(2))
    assert cpu_split.MAY_SPLIT
    cpu_split.forget()
    assert cpu_split.MAY_SPLIT and "split" not in cpu_split._state
