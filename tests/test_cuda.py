"""Native divergence on MLX's CUDA backend, no emulation (issue 8).

Re-checks what was recorded on one NVIDIA H200 (MLX 0.32.4; tests/cuda_data/): a short
`divergence run --policy native` of the embedded fixture under serial and
concurrent schedules, then `divergence bisect --confirm`. Runs only where MLX's
CUDA wheel and an NVIDIA GPU are present; elsewhere this module is one skip.
Collection imports nothing slow: the check below reads package metadata and /dev.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "tests" / "cuda_data"  # the prompts and the probe map recorded on one H200
CAUSE_KINDS = {"cache_contamination", "step_compute", "sampler"}


def gpu_available() -> bool:
    """MLX's CUDA wheel is installed and an NVIDIA device node exists (no mlx import)."""
    wheel = False
    for dist in ("mlx-cuda-13", "mlx-cuda-12", "mlx-cuda"):
        try:
            metadata.distribution(dist)
            wheel = True
            break
        except metadata.PackageNotFoundError:
            continue
    return wheel and bool(glob.glob("/dev/nvidia[0-9]*"))


pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not gpu_available(), reason="needs MLX's CUDA backend and an NVIDIA GPU"),
]


def _env() -> dict:
    """A child process's environment: offline, unbuffered, this checkout first on its path."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _cli(*args: str, ok=(0,)) -> dict:
    proc = subprocess.run([sys.executable, "-m", "divergence", *args, "--json"], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode in ok, f"divergence {args[0]} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)


def test_native_divergence_on_cuda_is_found_and_explained(tmp_path):
    import mlx.core as mx

    assert mx.cuda.is_available(), "MLX's CUDA wheel is installed but MLX sees no CUDA device"
    assert mx.default_device().type == mx.gpu

    out = tmp_path / "fixture"
    run = _cli("run", "--model", str(ROOT / "fixtures" / "target"), "--policy", "native",
               "--prompts", str(RESULTS / "prompts.jsonl"), "--max-tokens", "64", "--ignore-eos",
               "--out", str(out))
    assert run["policy"] == "native"

    report = _cli("bisect", str(out / "serial.h5"), str(out / "concurrent.h5"), "--confirm", ok=(0, 1))
    reqs = report["requests"]
    assert len(reqs) == 8
    # On the H200 every request's logits differ bitwise between schedules (from the first
    # concurrent decode steps on); 1 of 8 flips a token (p3 at generated #18 when recorded).
    numeric = [r for r in reqs if r["first_numeric_divergence"] is not None or r["status"] != "identical"]
    diverged = [r for r in reqs if r["status"] != "identical"]
    assert numeric, "serial and concurrent logits are bitwise identical: no native divergence on this GPU"
    assert diverged, "no request's tokens diverged (the recorded H200 run had 1 of 8)"
    for r in diverged:
        tok, cause = r["first_divergent_token"], r["root_cause"]
        assert tok is not None and tok["generated_index"] >= 0
        assert cause is not None and cause["kind"] in CAUSE_KINDS, r
        if cause["kind"] != "sampler":
            assert cause["rows_b"] > cause["rows_a"] == 1, cause  # a batched step vs the lone serial row
    unconfirmed = {r["id"]: r["root_cause"]["confirm_detail"] for r in diverged if r["confirmed"] is not True}
    assert not unconfirmed, f"root causes not confirmed by replay: {unconfirmed}"
    for r in diverged:
        # native labels on both sides: the proof is the step replayed request by request
        assert "request by request" in r["root_cause"]["confirm_detail"], r["root_cause"]["confirm_detail"]


def test_probe_maps_the_backend(tmp_path):
    report = _cli("probe", "--model", str(ROOT / "fixtures" / "target"), "--rows", "1..16")
    ops = {(o["op"], o["shape"]): o for o in report["ops"]}
    assert {"q_proj", "lm_head", "sdpa"} <= {op for op, _ in ops}
    for o in ops.values():
        assert len(o["classes"]) == len(o["rows"])
        if o["op"] != "attention":  # attention's base is per-seq: a masked batch of 1 may differ from it here
            assert o["classes"][0] == 0, o
    recorded = json.loads((RESULTS / "probe_fixture.json").read_text())
    same_device = (recorded["environment"].get("device_name") == report["environment"]["device_name"]
                   and recorded["environment"]["mlx"] == report["environment"]["mlx"])
    if same_device:
        # the same GPU model and MLX give the same map (first 16 row counts of the recorded 1..64)
        want = {(o["op"], o["shape"]): o["classes"][:len(ops[o["op"], o["shape"]]["classes"])]
                for o in recorded["ops"] if (o["op"], o["shape"]) in ops}
        # every linear op of the recorded map (sdpa and attention rows came later than it)
        assert {k for k in ops if k[0] not in ("sdpa", "attention")} <= set(want)
        assert {k: o["classes"] for k, o in ops.items() if k in want} == want


# -- the engine at one request is mlx-lm, bit for bit (issue 13) ---------------------------------
QWEN05B = dict(model_type="qwen2", hidden_size=896, num_layers=24, heads=14, kv_heads=2, intermediate_size=4864,
               vocab_size=151936, tie=True)
B1_PROMPTS = ["Return the number of items in a container.", "The socket module provides",
              "Convert a number or string to an integer, or return 0 if no arguments are given."]
B1_TOKENS = 32
# Long prompts (token counts): decoding crosses 256 and 1024 cached positions, where mlx-lm's
# KVCache buffer grows and MLX CUDA's SDPA reads row-contiguous K/V with another kernel
# than strided ones (attention.mlxlm_reads)
B1_LONG = (250, 1020)


class _LogitsTap:
    """Stands in for mlx-lm's model inside generate_step and keeps each call's last-row logits."""

    def __init__(self, model):
        self._model = model
        self.logits = []

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, inputs, cache=None, **kw):
        out = self._model(inputs, cache=cache, **kw)
        self.logits.append(out[:, -1, :])
        return out


def _b1_problems(tmp_path_factory, bits, prompts_of, compiled_step: bool | None = None) -> list[str]:
    """Where the engine's greedy tokens or top-k logits at B=1 differ from generate_step's."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import generate_step

    from divergence.core.request import Request
    from divergence.engine.engine import Engine
    from divergence.engine.model.loading import load_model
    from divergence.engine.sampling import float32
    from divergence.testing.models import make_random_model

    path = make_random_model(tmp_path_factory.mktemp("qwen05b"), dtype="bfloat16", quantize_bits=bits,
                             max_position_embeddings=32768, **QWEN05B)
    loaded = load_model(path)
    engine = Engine(loaded, policy="native", stop_at_eos=False, prefill="mlx-lm", compiled_step=compiled_step)
    problems = []
    for i, prompt in enumerate(prompts_of(loaded)):
        got = engine.run([Request(f"r{i}", tuple(prompt), max_tokens=B1_TOKENS)], "serial").outputs[f"r{i}"]
        tap = _LogitsTap(loaded.model)
        want = [int(t) for t, _ in generate_step(mx.array(prompt), tap, max_tokens=B1_TOKENS)]
        logits = tap.logits[1 : 1 + B1_TOKENS]  # [0] is the prefill of prompt[:-1]
        if got.tokens != want:
            first = next(j for j, (a, b) in enumerate(zip(got.tokens + [-1], want)) if a != b)
            problems.append(f"r{i} ({len(prompt)} prompt tokens): tokens differ from generated #{first}")
            continue
        for j, row in enumerate(logits):
            ref = float32(row[0])
            k = len(got.topk_ids[j])
            order = np.lexsort((np.arange(ref.size), -ref))[:k]
            if got.topk_logits[j].view(np.uint32).tolist() != ref[order].view(np.uint32).tolist():
                problems.append(f"r{i} ({len(prompt)} prompt tokens): top-k logits differ at generated #{j}")
                break
    return problems


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("bits", [None, 4], ids=["bf16", "4bit"])
def test_b1_native_is_generate_step_bit_for_bit(tmp_path_factory, bits, compiled):
    """Under `native` at B=1, with the prompt's last token computed as mlx-lm computes it
    (prefill="mlx-lm": its own one-row step), the engine's greedy tokens and top-k logits
    equal mlx-lm generate_step's own (tokens it yields, logits its model call returned), bit
    for bit, on the Qwen2.5-0.5B shape (random weights) in bf16 and 4-bit. (With the default
    whole-prompt prefill the last prompt row is computed inside the prefill's GEMM, where
    mlx-lm runs a one-row GEMV: on a GPU its logits then differ; see docs/your-model.md.)"""
    problems = _b1_problems(tmp_path_factory, bits, lambda m: [m.encode(text) for text in B1_PROMPTS], compiled)
    assert not problems, problems


def _compiled_step_harness():
    """tests/engine/test_compiled_step.py as a module (its per-op comparison of a compiled and an
    eager forward), loaded by path: the tests are no package."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("compiled_step_harness",
                                                  ROOT / "tests" / "engine" / "test_compiled_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("bits", [None, 4], ids=["bf16", "4bit"])
def test_compiled_decode_step_is_eager_per_op(tmp_path_factory, bits):
    """On MLX CUDA the compiled decode step (model/compiled_step.py) gives the eager step's bits:
    every tap point of every layer, the logits, the K/V written and the kernel records, at
    every decode step, B = 1 and 8, on the Qwen2.5-0.5B shape (random weights)."""
    from divergence.engine.model.loading import load_model
    from divergence.testing.models import make_random_model

    harness = _compiled_step_harness()
    path = make_random_model(tmp_path_factory.mktemp("qwen05b_compiled"), dtype="bfloat16", quantize_bits=bits,
                             **QWEN05B)
    loaded = load_model(path)
    prompts = [loaded.encode(text) for text in B1_PROMPTS * 3]
    for batch in (1, 8):
        harness._compare(loaded, prompts[:batch])


@pytest.mark.xfail(strict=False, reason="open: from 256 cached positions MLX CUDA's one-row SDPA numbers depend on "
                   "more than the K/V layout the engine now copies from mlx-lm's KVCache (mlxlm_reads); "
                   "1-ulp logit differences remain at some steps (docs/architecture.md: SDPA's kernel follows the K/V layout)")
@pytest.mark.parametrize("bits", [None, 4], ids=["bf16", "4bit"])
def test_b1_native_long_contexts_are_generate_step(tmp_path_factory, bits):
    """The same at prompts whose decode crosses 256 and 1024 cached positions, where mlx-lm's
    KVCache grows its buffer and hands SDPA K/V of another layout."""
    def long_prompts(m):
        stream = [t for text in B1_PROMPTS for t in m.encode(text)]
        return [(stream * (n // len(stream) + 1))[:n] for n in B1_LONG]
    problems = _b1_problems(tmp_path_factory, bits, long_prompts)
    assert not problems, problems


def _recorder():
    """An engine observer that keeps every KV write's hashes and every token's top-k logit bits."""
    import numpy as np

    from divergence.core.events import Observer

    class Record(Observer):
        wants_kv_hashes = True

        def __init__(self):
            self.writes, self.tokens = [], []

        def on_kv_write(self, w):
            self.writes.append(((w.step, w.layer, w.request_id), w.k_hashes.tobytes(), w.v_hashes.tobytes()))

        def on_token(self, t):
            self.tokens.append((t.step, t.request_id, t.token, t.topk_logits.view(np.uint32).tobytes()))

    return Record()


def _first_difference(a, b):
    """Where two runs of one batch first part: the first KV write (step, layer, request) whose
    hashes differ, or `tokens only`; None where every write and token is the same."""
    for (key, ka, va), (key_b, kb, vb) in zip(a.writes, b.writes):
        if key != key_b:
            return {"what": "schedule", "at": key}
        if ka != kb or va != vb:
            return {"what": "kv", "step_layer_request": key, "k_differs": ka != kb, "v_differs": va != vb}
    return {"what": "tokens only"} if a.tokens != b.tokens else None


def _repeat_check(tmp_path, policy: str, points: str) -> list[dict]:
    """The same batch (B prompts of `context` tokens, 6 tokens each) run 3 times on one Engine,
    random Qwen2.5-0.5B shape in bf16: each later run's first difference from the first."""
    from divergence.core.request import Request
    from divergence.engine.engine import Engine
    from divergence.engine.model.loading import load_model
    from divergence.testing.models import make_random_model

    path = make_random_model(tmp_path / "qwen05b", dtype="bfloat16", tokenizer_from=ROOT / "fixtures" / "target",
                             max_position_embeddings=32768, **QWEN05B)
    loaded = load_model(path)
    stream = [t for text in B1_PROMPTS for t in loaded.encode(text)]
    results = []
    for b, c in (tuple(int(x) for x in p.split(":")) for p in points.split(",")):
        prompts = [(stream * (c // len(stream) + 2))[i * 37:i * 37 + c] for i in range(b)]
        recs = []
        for _ in range(3):
            rec = _recorder()
            Engine(loaded, policy=policy, stop_at_eos=False, observers=[rec], prefill="mlx-lm",
                   token_budget=max(4096, b * c)).run(
                [Request(f"r{i}", tuple(p), max_tokens=6) for i, p in enumerate(prompts)], "concurrent")
            recs.append(rec)
        results.append({"batch": b, "context": c, "differences": [_first_difference(recs[0], r) for r in recs[1:]]})
    return results


def test_batched_decode_is_repeatable(tmp_path):
    """The same batch run again in one process gives the same bits: on the H200 the first
    decode step of 8 prompts of 1,024 tokens ran cuDNN in one run and MLX's vector kernel
    in the next (the choice follows the allocator's buffer sizes) until the batched reads
    stopped spanning a multiple of 256 rows (read_rows.batched_blocks). _repeat_check reports
    the first KV write where two runs part (None: none)."""
    results = _repeat_check(tmp_path, "native", "8:1024,64:512")
    assert len(results) == 2
    for r in results:
        assert r["differences"] == [None, None], (r["batch"], r["context"], r["differences"])


def test_batch_invariant_decode_is_repeatable(tmp_path):
    """batch-invariant runs every sequence alone (one-row calls): from 256 positions mlx-lm's
    layout leaves MLX CUDA's kernel to the allocator, so its one-row reads are the batched
    layout's (attention.stable_reads) and a run's bits are the same every time."""
    results = _repeat_check(tmp_path, "batch-invariant", "8:1024")
    assert len(results) == 1
    for r in results:
        assert r["differences"] == [None, None], (r["batch"], r["context"], r["differences"])
