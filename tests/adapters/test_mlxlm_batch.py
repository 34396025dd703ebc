"""mlx-lm's own BatchGenerator, traced through divergence.workloads.mlxlm_batch.

Checked against independent references: the serial trace's tokens equal mlx-lm's
`generate_step` one prompt at a time, and its KV hashes equal those of the
engine's own serial trace (same model, `native`, CPU bf16 where both are
row-invariant), which pins the adapter's (request, layer, position) mapping.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from divergence import Trace
from divergence.cli.main import main
from divergence.core.request import Request

PROMPTS = ["The socket module provides", "Return the number of", "This function is deprecated since",
           "Create a new thread", "Raise an exception if the"]


def _requests(loaded, n=12):
    return [Request(f"p{i}", tuple(loaded.encode(t)), max_tokens=n) for i, t in enumerate(PROMPTS)]


def _trace(loaded, reqs, schedule, path):
    from divergence.workloads.mlxlm_batch import run_batch_generator
    from divergence.trace.writer import TraceWriter

    with TraceWriter(path, top_k=8, kv_hashes=True) as w:
        return run_batch_generator(loaded, reqs, schedule, [w])


@pytest.fixture(scope="module")
def fixture_traces(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("bg")
    reqs = _requests(target)
    toks = {s: _trace(target, reqs, s, out / f"{s}.h5") for s in ("serial", "concurrent")}
    return out, reqs, toks


def test_serial_tokens_equal_generate_step(target, fixture_traces):
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    _, reqs, toks = fixture_traces
    for r in reqs:
        ref = []
        for tok, _ in generate_step(mx.array(r.prompt_tokens), target.model, max_tokens=r.max_tokens):
            ref.append(int(tok))
        assert toks["serial"][r.id] == ref


def test_kv_hashes_match_the_engines_serial_trace(target, fixture_traces, tmp_path):
    from divergence.engine.engine import Engine
    from divergence.trace.writer import TraceWriter

    out, reqs, _ = fixture_traces
    with TraceWriter(tmp_path / "engine.h5", top_k=8, kv_hashes=True) as w:
        Engine(target, policy="native", observers=[w], stop_at_eos=False).run(reqs, "serial")
    with Trace.open(out / "serial.h5") as a, Trace.open(tmp_path / "engine.h5") as e:
        for r in reqs:
            last = int(a.tokens(r.id).steps[-1])
            la = a.live_kv(r.id, at_step=last)
            le = e.live_kv(r.id, at_step=int(e.tokens(r.id).steps[-1]))
            key = lambda t: np.lexsort((np.asarray(t["layer"]), np.asarray(t["position"])))  # noqa: E731
            ia, ie = key(la), key(le)
            n = len(ia)  # the adapter's last token is never fed back, nor is the engine's
            assert n > 0 and n == len(ie)
            for col in ("layer", "position", "k_hash", "v_hash"):
                assert np.array_equal(np.asarray(la[col])[ia], np.asarray(le[col])[ie]), (r.id, col)


def test_traces_diff_and_replay_bit_for_bit(fixture_traces, capsys):
    """The engine stands in for BatchGenerator: replaying its traces (its step plans, its
    prefill layout, its log-prob top-k) gives its tokens, top-k and K/V bit for bit
    (fixture bf16, prompts of different lengths: its right-padded prefill included)."""
    from divergence.analysis.replayer import replay

    out, reqs, toks = fixture_traces
    assert main(["diff", str(out / "serial.h5"), str(out / "concurrent.h5"), "--json"]) in (0, 1)
    report = json.loads(capsys.readouterr().out)
    assert {r["id"] for r in report["requests"]} == {r.id for r in reqs}
    with Trace.open(out / "concurrent.h5") as b:
        assert b.meta["settings"]["engine"] == "mlx-lm BatchGenerator"
        # all five prompts were prefilled in one batched step
        assert max(len(p.slices) for p in b.iter_plans()) == len(reqs)
    for s in ("serial", "concurrent"):
        rep = replay(out / f"{s}.h5", out=out / f"{s}.replay.h5")
        assert rep.faithful and rep.tokens_equal and rep.logits_equal and rep.kv_equal, (s, rep.first_difference)
        with Trace.open(out / f"{s}.replay.h5") as r:
            assert r.meta["settings"]["topk_values"] == "logprobs" and r.meta["settings"]["prefill"] == "mlx-lm"


@pytest.mark.parametrize("lengths", ["equal", "mixed"])
def test_a_batch_generator_divergence_is_confirmed_through_replay(random_model, tmp_path, capsys, lengths):
    """fp32 on OpenBLAS: BatchGenerator's serial and concurrent traces differ in their
    logits; both replay bit for bit in the engine (prompts of different lengths too: the
    `padded` kernel lays a step out as its right-padded batch), so bisect --confirm
    re-executes the concurrent trace with the cause step request by request and confirms
    every request's root cause."""
    from divergence.analysis.replayer import replay
    from divergence.engine.kernels.blas import blas_in_use

    if not blas_in_use().startswith("OpenBLAS"):
        pytest.skip("needs OpenBLAS: MLX's reference BLAS is row-invariant, nothing diverges (.ci/run installs it)")
    loaded = random_model("qwen3", hidden_size=256, num_layers=3, heads=4, kv_heads=2, intermediate_size=512,
                          dtype="float32")
    rng = np.random.default_rng(5)
    sizes = [16] * 6 if lengths == "equal" else [16, 5, 23, 9, 16, 12]
    reqs = [Request(f"p{i}", tuple(int(t) for t in rng.integers(3, 1000, n)), max_tokens=10)
            for i, n in enumerate(sizes)]
    for s in ("serial", "concurrent"):
        _trace(loaded, reqs, s, tmp_path / f"{s}.h5")
        rep = replay(tmp_path / f"{s}.h5", out=tmp_path / f"{s}.replay.h5")
        assert rep.faithful, (s, rep.first_difference, rep.kv_first_difference)
    assert main(["bisect", str(tmp_path / "serial.h5"), str(tmp_path / "concurrent.h5"), "--confirm",
                 "--bitwise", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    diverged = [r for r in report["requests"] if r.get("root_cause")]
    assert diverged and len(diverged) == len(report["requests"])
    unconfirmed = {r["id"]: r["root_cause"]["confirm_detail"] for r in diverged if r["confirmed"] is not True}
    assert not unconfirmed
    assert all("request by request" in r["root_cause"]["confirm_detail"] for r in diverged)


def test_numeric_divergence_gets_a_root_cause_step(random_model, tmp_path):
    """fp32 random model: with OpenBLAS the batched steps move the logits; bisect's walk
    from the first numeric difference lands on a batched concurrent step."""
    from divergence.analysis.bisect import find_root_cause
    from divergence.analysis.diff import diff_traces
    from divergence.engine.kernels.blas import blas_in_use

    loaded = random_model("llama", hidden_size=256, num_layers=2, heads=4, kv_heads=2, intermediate_size=512,
                          dtype="float32")
    reqs = [Request(f"p{i}", tuple(loaded.encode(t)), max_tokens=8) for i, t in enumerate(PROMPTS)]
    for s in ("serial", "concurrent"):
        _trace(loaded, reqs, s, tmp_path / f"{s}.h5")
    with Trace.open(tmp_path / "serial.h5") as a, Trace.open(tmp_path / "concurrent.h5") as b:
        d = diff_traces(a, b)
        moved = [r for r in d.requests if r.first_numeric_divergence is not None]
        if not blas_in_use().startswith("OpenBLAS"):
            assert not moved  # MLX's reference BLAS is row-invariant (.ci/run installs OpenBLAS)
            return
        assert moved
        cause = find_root_cause(a, b, moved[0])
        assert cause is not None
        assert len(cause.b.composition) > 1 and cause.a.rows < cause.b.rows


_MOE_ROUTING = """
import sys
from pathlib import Path
from divergence import Trace
from divergence.analysis.replayer import replay
from divergence.core.request import Request
from divergence.engine.model.loading import load_model
from divergence.workloads.mlxlm_batch import run_batch_generator
from divergence.trace.writer import TraceWriter
from divergence.testing.models import make_random_model
out = Path(sys.argv[1])
path = make_random_model(str(out / "moe"), model_type="qwen3_moe", hidden_size=128, num_layers=2, heads=4,
                         kv_heads=2, intermediate_size=256, vocab_size=1024, tie=True, dtype="float32",
                         tokenizer_from=sys.argv[2])
loaded = load_model(path)
reqs = [Request(f"p{i}", tuple(range(5 + i, 5 + i + n)), max_tokens=6) for i, n in enumerate((7, 3, 12, 5))]
routes = {}
for s in ("serial", "concurrent"):
    with TraceWriter(out / f"{s}.h5", top_k=8, kv_hashes=True) as w:
        run_batch_generator(loaded, reqs, s, [w])
    rep = replay(out / f"{s}.h5", out=out / f"{s}.replay.h5")
    assert rep.faithful, (s, rep.first_difference, rep.kv_first_difference)
    with Trace.open(out / f"{s}.h5") as orig, Trace.open(out / f"{s}.replay.h5") as r:
        for q in reqs:
            rt, kv = r.routing(q.id), orig.live_kv(q.id)
            got = {(int(l), int(p)): (tuple(e), int(h)) for l, p, e, h in
                   zip(rt["layer"], rt["position"], rt["experts"].tolist(), rt["input_hash"])}
            assert len(got) == len(rt["layer"]), (s, q.id)  # each position once per layer
            assert sorted(got) == sorted(zip(kv["layer"].tolist(), kv["position"].tolist())), (s, q.id)
            routes[s, q.id] = got
for q in reqs:
    assert routes["serial", q.id] == routes["concurrent", q.id], q.id
print("ok")
"""


def test_moe_batch_generator_trace_replays_with_routing_of_real_rows(tmp_path):
    """A MoE model (qwen3_moe, fp32 on MLX's reference BLAS, which is row-invariant; mlx's
    CPU gather_mm is fp32 only), prompts of different lengths: both of BatchGenerator's
    traces replay bit for bit, and the concurrent replay's routing (rows padded under
    `padded`) equals the serial replay's position by position: the records hold the plan's
    rows, each computed position once per layer, not the padded batch's."""
    import os
    import subprocess
    import sys

    from divergence.fixtures import TARGET

    env = dict(os.environ, DIVERGENCE_BLAS="reference")
    p = subprocess.run([sys.executable, "-c", _MOE_ROUTING, str(tmp_path), str(TARGET)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-3000:]
