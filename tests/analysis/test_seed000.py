"""The seed-000 story end to end on the trained fixtures, through the CLI.

r1 decodes with speculative decoding (k=3: 4 verify rows, the seed's "4
verification tokens") when r2's 154-token prompt arrives; under threshold:4 one
concurrent step packs r2's prefill with r1's verify rows and runs gemm, r2
finishes, and r1 diverges ~120 tokens later. bisect must name that step,
classify cache contamination, list r2, and replay must confirm it.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from divergence import Trace
from divergence.cli.main import main


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    assert main(["run", "--out", str(out), "--json"]) == 0  # diverged, and recorded (--check makes it 1)
    return out


def test_run_reports_the_divergence(demo, capsys):
    with Trace.open(demo / "serial.h5") as a, Trace.open(demo / "concurrent.h5") as b:
        assert a.completed and b.completed
        assert a.meta["policy"] == "threshold:4" and a.meta["settings"]["spec_k"] == 3


def test_bisect_confirms_seed_000(demo, capsys):
    capsys.readouterr()
    rc = main(["bisect", str(demo / "serial.h5"), str(demo / "concurrent.h5"), "--confirm", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 1 and not report["identical"]
    r1 = next(r for r in report["requests"] if r["id"] == "r1")
    assert r1["status"] == "diverged"
    tok = r1["first_divergent_token"]
    assert tok["a"]["token"] != tok["b"]["token"] and tok["position"] > 100
    cause = r1["root_cause"]
    assert cause["kind"] == "cache_contamination"
    assert cause["co_batched_b"] == ["r2"]
    comp = {c["request_id"]: c["phase"] for c in cause["composition_b"]}
    assert comp == {"r1": "verify", "r2": "prefill"}
    assert cause["rows_b"] > 120 and cause["rows_a"] == 4
    assert cause["kernel_b"].startswith("gemm") and cause["kernel_a"] == "gemv"
    assert "r2" in cause["finished_before_divergence"]
    assert r1["confirmed"] is True
    # the other requests are identical, and say so
    assert {r["id"]: r["status"] for r in report["requests"] if r["id"] != "r1"} == \
           {"r2": "identical", "r3": "identical", "r4": "identical"}


def test_replay_is_bitwise_faithful(demo, tmp_path, capsys):
    for name in ("serial", "concurrent"):
        capsys.readouterr()
        assert main(["replay", str(demo / f"{name}.h5"), "--out", str(tmp_path / f"{name}.h5"), "--json"]) == 0
        r = json.loads(capsys.readouterr().out)
        assert r["faithful"] and r["tokens_equal"] and r["logits_equal"] and r["kv_equal"], r


def test_forcing_the_root_step_changes_only_what_it_should(demo, tmp_path, capsys):
    with Trace.open(demo / "concurrent.h5") as b:
        step = next(p.index for p in b.iter_plans() if {s.request_id for s in p.slices} == {"r1", "r2"})
    capsys.readouterr()
    out = tmp_path / "forced.h5"
    assert main(["replay", str(demo / "concurrent.h5"), "--force", f"{step}:gemv", "--out", str(out), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert not r["faithful"] and r["first_difference"]["request"] in ("r1", "r2")
    with Trace.open(demo / "serial.h5") as a, Trace.open(demo / "concurrent.h5") as b, Trace.open(out) as f:
        ta, tb, tf = a.tokens("r1"), b.tokens("r1"), f.tokens("r1")
        flip = int(np.flatnonzero(ta.tokens != tb.tokens)[0])
        # teacher-forced on the concurrent schedule, the forced replay picks serial's token at the flip
        assert np.array_equal(tf.tokens[: flip + 1], ta.tokens[: flip + 1])
        assert tf.tokens[flip] != tb.tokens[flip]


def test_diff_identical_traces_exit_0(demo, capsys):
    p = str(demo / "serial.h5")
    assert main(["diff", p, p]) == 0
    assert "identical: 4 of 4" in capsys.readouterr().out


def test_without_kv_hashes_bisect_falls_back_to_replay_bisection(tmp_path, capsys):
    out = tmp_path / "nohash"
    assert main(["run", "--out", str(out), "--no-kv-hashes", "--json"]) == 0
    capsys.readouterr()
    rc = main(["bisect", str(out / "serial.h5"), str(out / "concurrent.h5"), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 1 and report["mode"].startswith("replay bisection")
    r1 = next(r for r in report["requests"] if r["id"] == "r1")
    cause = r1["root_cause"]
    assert cause["kind"] == "cache_contamination" and cause["co_batched_b"] == ["r2"]
    assert cause["kernel_b"].startswith("gemm") and cause["kernel_a"] == "gemv"
    assert r1["confirmed"] is True
