"""Independent reference: under `native` kernels at B=1 the engine's greedy tokens
equal mlx-lm's own generate_step, on every supported family and format."""
from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from divergence.engine.engine import Engine
from divergence.core.request import Request
from divergence.testing.models import ROPE_VARIANTS

N_TOKENS = 48


def mlx_lm_tokens(loaded, prompt_tokens, n):
    return [int(t) for t, _ in generate_step(mx.array(prompt_tokens), loaded.model, max_tokens=n)]


def check_against_mlx_lm(loaded, prompts, n=N_TOKENS):
    engine = Engine(loaded, policy="native", stop_at_eos=False)
    reqs = [Request(f"r{i}", tuple(loaded.encode(p)), max_tokens=n) for i, p in enumerate(prompts)]
    result = engine.run(reqs, "serial")
    mismatches = []
    for r in reqs:
        ref = mlx_lm_tokens(loaded, r.prompt_tokens, n)
        got = result.outputs[r.id].tokens
        if got != ref:
            first = next(i for i, (a, b) in enumerate(zip(got + [-1], ref)) if a != b)
            mismatches.append(f"{r.id}: first mismatch at generated #{first}")
    assert len(reqs) >= 8
    assert not mismatches, mismatches


def test_bf16_fixture_matches_mlx_lm(target, prompts):
    assert target.dtype == "bfloat16"
    check_against_mlx_lm(target, prompts)


def test_4bit_fixture_matches_mlx_lm(target_4bit, prompts):
    assert target_4bit.config.get("quantization", {}).get("bits") == 4
    check_against_mlx_lm(target_4bit, prompts)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_random_families_match_mlx_lm(random_model, prompts, family):
    loaded = random_model(family, hidden_size=64)
    if family == "qwen2":  # q/k/v biases are what makes qwen2 qwen2
        assert "bias" in loaded.model.layers[0].self_attn.q_proj
    if family == "qwen3":
        assert hasattr(loaded.model.layers[0].self_attn, "q_norm")
    check_against_mlx_lm(loaded, prompts)


SHARED_ON_CPU = {"llama3-scaling", "linear-scaling"}  # the plain mx.fast.rope calls


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_rope_variants_match_mlx_lm(random_model, prompts, variant):
    from divergence.engine.model.rotary import shared_rope

    loaded = random_model("llama", hidden_size=64, extra_config=ROPE_VARIANTS[variant])
    ropes = [layer.self_attn.rope for layer in loaded.model.layers]
    assert (shared_rope(ropes) is not None) == (variant in SHARED_ON_CPU), type(ropes[0]).__name__
    check_against_mlx_lm(loaded, prompts, n=24)


@pytest.mark.blas
def test_fp32_override_matches_mlx_lm(prompts):
    from divergence.engine.model.loading import load_model
    from divergence.fixtures import TARGET

    loaded = load_model(TARGET, dtype="float32")
    assert loaded.dtype == "float32"
    check_against_mlx_lm(loaded, prompts[:8], n=24)


def test_mlx_lm_prefill_layout(random_model, prompts):
    """prefill="mlx-lm": the prefill computes all but the last prompt token and the first
    decode step feeds that one (mlx-lm's generate_step makes the same two calls), so each
    request's steps have mlx-lm's shapes; tokens still equal generate_step's."""
    from divergence.core.events import Observer

    class Plans(Observer):
        def __init__(self):
            self.plans = []

        def on_step(self, e):
            self.plans.append(e.plan)

    loaded = random_model("qwen2", hidden_size=64)
    ob = Plans()
    engine = Engine(loaded, policy="native", stop_at_eos=False, prefill="mlx-lm", observers=[ob])
    reqs = [Request(f"r{i}", tuple(loaded.encode(p)), max_tokens=8) for i, p in enumerate(prompts[:3])]
    result = engine.run(reqs, "serial")
    for r in reqs:
        steps = [(p.index, s) for p in ob.plans for s in p.slices if s.request_id == r.id]
        (_, pre), (_, first) = steps[0], steps[1]
        n = len(r.prompt_tokens)
        assert (pre.phase, pre.start, pre.count, pre.logit_rows) == ("prefill", 0, n - 1, ())
        assert (first.phase, first.start, first.tokens) == ("decode", n - 1, (r.prompt_tokens[-1],))
        assert result.outputs[r.id].tokens == mlx_lm_tokens(loaded, r.prompt_tokens, 8)
    assert engine.settings()["prefill"] == "mlx-lm"


@pytest.mark.parametrize("n", [250, 520])
def test_long_contexts_match_mlx_lm(target, prompts, n):
    """Prompts whose decode crosses 256 (and 512) cached positions, where mlx-lm's KVCache
    grows its buffer and hands SDPA K/V of another stride (attention.mlxlm_reads)."""
    stream = [t for p in prompts for t in target.encode(p)]
    prompt = tuple((stream * (n // len(stream) + 1))[:n])
    engine = Engine(target, policy="native", stop_at_eos=False, prefill="mlx-lm")
    got = engine.run([Request("r", prompt, max_tokens=16)], "serial").outputs["r"].tokens
    assert got == mlx_lm_tokens(target, prompt, 16)


def test_vocab_pieces_are_each_id_decoded_alone(target):
    """The trace's vocabulary (batch-decoded for speed) is what decoding each id alone gives."""
    engine = Engine(target)
    assert engine.vocab_pieces() == [target.decode([i]) for i in range(engine.vocab)]
