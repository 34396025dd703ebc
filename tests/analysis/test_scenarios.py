"""The three configurations issue 14 measured falling short, rebuilt with our own prompts,
each confirmed end to end through the CLI: prefix caching with staggered arrivals under
threshold:4; temperature / top-p / seeds with speculative decoding; and logit-only drift
of a random qwen3 fp32 model under `native` on the optimized BLAS (--bitwise)."""
from __future__ import annotations

import json

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


def test_prefix_cache_with_staggered_arrivals_is_replayed_and_confirmed(tmp_path, capsys):
    """Four requests share a 57-token preamble (three full 16-token blocks) and arrive two
    steps apart: in the concurrent run the later ones take the preamble from the prefix cache.
    Replay must serve those positions from the cache as the run did, or nothing confirms."""
    texts = ["The socket module provides", "Return the number of", "If the object", "Open file and return a stream."]
    prompts = _prompts(tmp_path / "p.jsonl", [{"id": f"r{i}", "prompt": PREAMBLE + t, "arrival": 3 * i,
                                               "max_tokens": 32} for i, t in enumerate(texts)])
    out = tmp_path / "traces"
    assert main(["run", "--prompts", str(prompts), "--prefix-cache", "--policy", "threshold:4", "--spec-k", "0",
                 "--token-budget", "16", "--ignore-eos", "--out", str(out), "--json"]) == 0
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
                 "--out", str(out), "--json"]) == 0
    return out


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
