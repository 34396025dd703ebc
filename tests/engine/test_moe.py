"""Mixture-of-experts families (qwen3_moe, mixtral): under `native` at B=1 the
engine's greedy tokens equal mlx-lm's own generate_step (the independent reference),
in fp32 and mlx-lm 4-bit; bf16 runs too (mlx-lm itself cannot there: mlx's CPU
gather_mm is float32-only)."""
from __future__ import annotations

import mlx.core as mx
import pytest

from divergence.core.request import Request
from divergence.engine.engine import Engine
from divergence.engine.kernels.experts import gather_mm_supported
from divergence.engine.model.moe import MoeBlock



def check_against_mlx_lm(loaded, prompts, n):
    from mlx_lm.generate import generate_step

    engine = Engine(loaded, policy="native", stop_at_eos=False)
    reqs = [Request(f"r{i}", tuple(loaded.encode(p)), max_tokens=n) for i, p in enumerate(prompts)]
    result = engine.run(reqs, "serial")
    bad = []
    for r in reqs:
        ref = [int(t) for t, _ in generate_step(mx.array(r.prompt_tokens), loaded.model, max_tokens=n)]
        if result.outputs[r.id].tokens != ref:
            bad.append(r.id)
    assert len(reqs) >= 8 and not bad, bad

MOE = dict(hidden_size=64, num_layers=2, num_experts=8, experts_per_token=2)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("fmt", ["float32", "4bit"])
def test_moe_families_match_mlx_lm(random_model, prompts, family, fmt):
    kw = dict(dtype="float32") if fmt == "float32" else dict(dtype="bfloat16", quantize_bits=4)
    loaded = random_model(family, **MOE, **kw)
    blocks = [b for b in _blocks(loaded) if isinstance(b, MoeBlock)]
    assert len(blocks) == 2 and blocks[0].top_k == 2 and blocks[0].num_experts == 8
    if fmt == "4bit":
        assert blocks[0].experts.quantized
        if family == "qwen3_moe":  # mlx-lm's own predicate keeps the router at 8 bits
            assert blocks[0].gate.module.bits == 8
    check_against_mlx_lm(loaded, prompts, n=24)


def test_bf16_moe_runs_where_mlx_lm_cannot(random_model, prompts):
    loaded = random_model("qwen3_moe", **MOE, dtype="bfloat16")
    if not gather_mm_supported(mx.bfloat16):  # documents why there is no mlx-lm reference here
        with pytest.raises(RuntimeError, match="GatherMM"):
            from mlx_lm.generate import generate_step
            list(generate_step(mx.array([1, 2, 3]), loaded.model, max_tokens=2))
    engine = Engine(loaded, policy="native", stop_at_eos=False)
    reqs = [Request(f"r{i}", tuple(loaded.encode(p)), max_tokens=8) for i, p in enumerate(prompts[:4])]
    serial, concurrent = engine.run(reqs, "serial"), engine.run(reqs, "concurrent")
    assert all(len(serial.outputs[r.id].tokens) == 8 for r in reqs)
    assert {r.id: serial.outputs[r.id].tokens for r in reqs} == {r.id: concurrent.outputs[r.id].tokens for r in reqs}


def _blocks(loaded):
    from divergence.engine.model.forward import PackedForward

    return PackedForward(loaded).moe


def test_unsupported_family_names_the_supported_ones(tmp_path, capsys):
    import json

    from divergence.cli.main import main
    from divergence.engine.model.loading import load_model
    from divergence.errors import UnsupportedModelError

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    with pytest.raises(UnsupportedModelError) as e:
        load_model(tmp_path)
    assert "'gpt_oss'" in str(e.value) and "qwen3_moe, mixtral" in str(e.value)
    capsys.readouterr()
    assert main(["run", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "qwen3_moe" in err and "Traceback" not in err
