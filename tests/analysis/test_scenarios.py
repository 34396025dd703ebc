"""The three configurations issue 14 measured falling short, rebuilt with our own prompts,
each confirmed end to end through the CLI: prefix caching with staggered arrivals under
threshold:4; temperature / top-p / seeds with speculative decoding; and logit-only drift
of a random qwen3 fp32 model under `native` on the optimized BLAS (--bitwise)."""
from __future__ import annotations

import json
import re

import pytest

from divergence import Trace
from divergence.cli.main import main

PREAMBLE = ("Return a new list containing all items from the iterable in ascending order. A custom key function "
            "can be supplied to customize the sort order, and the reverse flag can be set. ")


def _prompts(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _bisect(capsys, a, b, *extra):
    capsys.readouterr()
    rc = main(["bisect", str(a), str(b), "--confirm", "--json", *extra])
    return rc, json.loads(capsys.readouterr().out)


def _replay_is_faithful(capsys, trace):
    capsys.readouterr()
    assert main(["replay", str(trace), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["faithful"] and r["tokens_equal"] and r["logits_equal"] and r["kv_equal"], r
    assert r["draws_equal"] is not False, r


def test_prefix_cache_with_staggered_arrivals_is_replayed_and_confirmed(tmp_path, capsys):
    """Four requests share a 57-token preamble (three full 16-token blocks) and arrive two
    steps apart: in the concurrent run the later ones take the preamble from the prefix cache.
    Replay must serve those positions from the cache as the run did, or nothing confirms."""
    texts = ["The socket module provides", "Return the number of", "If the object", "Open file and return a stream."]
    prompts = _prompts(tmp_path / "p.jsonl", [{"id": f"r{i}", "prompt": PREAMBLE + t, "arrival": 3 * i,
                                               "max_tokens": 32} for i, t in enumerate(texts)])
    out = tmp_path / "traces"
    assert main(["run", "--prompts", str(prompts), "--prefix-cache", "--policy", "threshold:4", "--spec-k", "0",
                 "--token-budget", "16", "--ignore-eos", "--out", str(out), "--json"]) in (0, 1)
    capsys.readouterr()
    with Trace.open(out / "concurrent.h5") as b:
        first: dict = {}
        for plan in b.iter_plans():
            for s in plan.slices:
                first.setdefault(s.request_id, s.start)
        assert sorted(rid for rid, start in first.items() if start > 0) == ["r1", "r2", "r3"]  # prefix hits
    for name in ("serial", "concurrent"):
        _replay_is_faithful(capsys, out / f"{name}.h5")
    rc, report = _bisect(capsys, out / "serial.h5", out / "concurrent.h5", "--bitwise")
    assert rc == 1
    diverged = [r for r in report["requests"] if r["status"] == "diverged"]
    flips = [r for r in diverged if r["first_divergent_token"] is not None]
    assert flips, "the scenario must flip a token"
    assert len(diverged) >= 2
    for r in diverged:
        assert r["root_cause"] is not None and r["confirmed"] is True, (r["id"], r["root_cause"])


@pytest.fixture(scope="module")
def qwen3_fp32(tmp_path_factory):
    """A random qwen3 (q/k norms) in fp32 under native, 8 prompts prefilled together."""
    import divergence.engine  # noqa: F401  (the optimized BLAS before MLX)
    from divergence.fixtures import TARGET
    from divergence.testing.models import make_random_model

    root = tmp_path_factory.mktemp("qwen3-native")
    model = make_random_model(root / "model", model_type="qwen3", hidden_size=256, num_layers=2, heads=4, kv_heads=2,
                              intermediate_size=512, dtype="float32", tokenizer_from=TARGET)
    texts = ["The socket module provides", "Return the number of", "This function is deprecated since",
             "Create a new thread", "Raise an exception if the", "The default encoding is", "Open the file and",
             "If the argument is omitted"]
    prompts = _prompts(root / "p.jsonl", [{"id": f"p{i}", "prompt": t, "max_tokens": 12} for i, t in enumerate(texts)])
    out = root / "traces"
    assert main(["run", "--model", str(model), "--policy", "native", "--prompts", str(prompts), "--ignore-eos",
                 "--out", str(out), "--json"]) in (0, 1)
    return out


@pytest.mark.blas
def test_logit_only_drift_gets_a_root_cause_and_a_confirmation_with_bitwise(qwen3_fp32, capsys):
    a, b = qwen3_fp32 / "serial.h5", qwen3_fp32 / "concurrent.h5"
    with Trace.open(a) as ta:
        if "OpenBLAS" not in str(ta.meta["environment"].get("blas", "")):
            pytest.skip("needs the optimized BLAS (libopenblas0-pthread), whose fp32 sgemm depends on the row count")
    capsys.readouterr()
    assert main(["bisect", str(a), str(b)]) == 0  # tokens identical: not a divergence by default...
    text = capsys.readouterr().out
    assert "tokens identical" in text and "logits differ from position" in text  # ...but never a bare "identical"
    rc, report = _bisect(capsys, a, b, "--bitwise")
    assert rc == 1
    drifted = [r for r in report["requests"] if r["status"] == "diverged"]
    assert len(drifted) >= 4
    for r in drifted:
        assert r["first_divergent_token"] is None and r["first_numeric_divergence"] is not None
        assert r["root_cause"] is not None and r["confirmed"] is True, (r["id"], r["root_cause"])
        assert "bit for bit" in r["root_cause"]["confirm_detail"]
        # --confirm also replays both root steps op by op: under `native` every kernel label is
        # the same, so the op whose output bits differ is the lead (here a linear op of layer 0)
        op = r["root_cause"]["first_op"]
        assert op is not None and op["layer"] == 0 and op["op"] in ("q_proj", "k_proj", "v_proj"), op
        assert op["max_abs_delta"] > 0 and "input_layernorm" in op["equal_before"]
    capsys.readouterr()
    assert main(["bisect", str(a), str(b), "--bitwise", "--ops"]) == 1
    text = capsys.readouterr().out
    assert "first op that differed: layer 0 " in text and " differ first (max |Δ| " in text
    assert "input_layernorm" in text and "equal" in text


def _sampled_prompts(path, texts, max_tokens):
    return _prompts(path, [{"id": f"r{i}", "prompt": t, "arrival": 2 * i, "max_tokens": max_tokens,
                            "temperature": 0.8, "top_p": 0.95, "seed": 7 + i} for i, t in enumerate(texts)])


def test_sampling_with_speculative_decoding_is_replayed_and_confirmed(tmp_path, capsys):
    """Temperature 0.8, top_p 0.95, a seed per request, spec k=3 under threshold:4: the
    rejection test must replay exactly what the recording accepted, and every divergence
    (tokens, and logits with --bitwise) is confirmed; the flips say where u fell."""
    texts = ["The socket module provides", "Return the number of", "If the object", "Open file and return a stream."]
    prompts = _sampled_prompts(tmp_path / "p.jsonl", texts, 24)
    out = tmp_path / "traces"
    assert main(["run", "--prompts", str(prompts), "--spec-k", "3", "--policy", "threshold:4", "--ignore-eos",
                 "--out", str(out), "--json"]) in (0, 1)
    for name in ("serial", "concurrent"):
        _replay_is_faithful(capsys, out / f"{name}.h5")
    with Trace.open(out / "concurrent.h5") as b:  # the engine recorded every draw, rejection tests included
        purposes = set(b.table("draws")["purpose"])
        assert {"draft", "accept"} <= purposes and purposes & {"residual", "sample"}
    rc, report = _bisect(capsys, out / "serial.h5", out / "concurrent.h5", "--bitwise")
    assert rc == 1
    diverged = [r for r in report["requests"] if r["status"] == "diverged"]
    flips = [r for r in diverged if r["first_divergent_token"] is not None]
    assert flips
    for r in diverged:
        assert r["root_cause"] is not None and r["confirmed"] is True, (r["id"], r["root_cause"])
    for r in flips:
        story = r["root_cause"]["sampler"]
        assert story is not None and story["text"].startswith("u = "), r["id"]
        for side in ("a", "b"):
            assert r["first_divergent_token"][side]["logit"] is not None  # the token's own logit, never nan
    capsys.readouterr()
    main(["bisect", str(out / "serial.h5"), str(out / "concurrent.h5"), "--bitwise"])
    text = capsys.readouterr().out
    assert "fell in token" in text and not re.search(r"\bnan\b", text, re.I)


@pytest.fixture
def draft_only_row_dependent(monkeypatch):
    """A stand-in backend on which only the draft's shapes (hidden 128) depend on the row
    count (split-K above one row): the target's logits stay bitwise equal under batching,
    the draft's q moves, and with it the sampled tokens."""
    from divergence.engine.kernels import linear as kernels

    native = kernels.run_native

    def run_native(x, op):
        if (op.k != 128 and op.n != 128) or x.shape[0] <= 1:
            return native(x, op)
        return kernels.run_gemm(x, op, kernels.gemm_splits(x.shape[0], op.n, op.k))

    monkeypatch.setattr(kernels, "run_native", run_native)


def test_a_sampler_cause_is_led_by_the_draft_step_and_confirmed_at_the_draw(tmp_path, capsys,
                                                                          draft_only_row_dependent):
    texts = ["The socket module provides", "Return the number of", "If the object", "Open file and return a stream."]
    prompts = _sampled_prompts(tmp_path / "p.jsonl", texts, 32)
    out = tmp_path / "traces"
    assert main(["run", "--prompts", str(prompts), "--spec-k", "3", "--policy", "native", "--ignore-eos",
                 "--out", str(out), "--json", "--check"]) == 1  # --check: 1, the schedules diverged
    rc, report = _bisect(capsys, out / "serial.h5", out / "concurrent.h5")
    assert rc == 1
    diverged = [r for r in report["requests"] if r["status"] == "diverged"]
    assert diverged
    for r in diverged:
        c = r["root_cause"]
        assert c["kind"] == "sampler" and c["model"] == "draft", (r["id"], c["kind"])
        assert r["first_numeric_divergence"] is None or \
            r["first_numeric_divergence"]["position"] > r["first_divergent_token"]["position"]
        assert c["sampler"]["purpose"] in ("draft", "accept", "residual")
        assert r["confirmed"] is True, c["confirm_detail"]
        assert "as in serial" in c["confirm_detail"]
        assert c["first_op"] is not None  # the draft step's own op that differed
    capsys.readouterr()
    main(["bisect", str(out / "serial.h5"), str(out / "concurrent.h5")])
    text = capsys.readouterr().out
    assert "root cause: sampler: the target's logits are bitwise equal up to the flip; the draft's q differs:" in text
    assert re.search(r"u = 0\.\d{5} \(.*\) fell in token \d+'s interval \[0\.\d{4}, 0\.\d{4}\) in serial and in "
                     r"token \d+'s \[0\.\d{4}, 0\.\d{4}\) in concurrent", text)


@pytest.mark.blas  # traces/v1 was recorded under OpenBLAS: under another BLAS the replay runs in a child
def test_a_trace_from_before_draws_and_schema_2_still_replays_bit_for_bit(capsys):
    """The committed schema-1 demo pair (no draws, no token logits) replays faithfully."""
    from divergence.fixtures import DRAFT, TARGET
    from pathlib import Path

    v1 = Path(__file__).resolve().parents[2] / "traces" / "v1" / "concurrent.h5"
    capsys.readouterr()
    assert main(["replay", str(v1), "--model", str(TARGET), "--draft", str(DRAFT), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["faithful"], r


def test_mlx_lm_prefill_layout_prefix_cache_and_sampled_speculation_replay_and_confirm(tmp_path, capsys):
    """The engine's other prefill layout (the prompt's last token in the first decode step,
    as mlx-lm does) with the prefix cache, spec k=3 and sampling, all three schedules: every
    trace replays bit for bit (draws included) and every divergence is confirmed, the flips
    that the draft's own proposal decided included (proven at that draw)."""
    texts = ["The socket module provides", "Return the number of", "If the object", "Open file and return a stream."]
    prompts = _sampled_prompts(tmp_path / "p.jsonl", texts, 24)
    out = tmp_path / "traces"
    assert main(["run", "--prompts", str(prompts), "--spec-k", "3", "--policy", "threshold:4", "--ignore-eos",
                 "--prefill", "mlx-lm", "--prefix-cache", "--schedules", "serial,concurrent,warm",
                 "--out", str(out), "--json"]) in (0, 1)
    for name in ("serial", "concurrent", "warm"):
        _replay_is_faithful(capsys, out / f"{name}.h5")
    for other in ("concurrent", "warm"):
        _, report = _bisect(capsys, out / "serial.h5", out / f"{other}.h5", "--bitwise")
        for r in report["requests"]:
            if r["status"] == "diverged":
                assert r["root_cause"] is not None and r["confirmed"] is True, (other, r["id"], r["root_cause"])
