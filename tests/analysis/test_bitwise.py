"""--bitwise, logit-only drift in words, no `nan` in reports, and forced steps checked
against the trace: on hand-built traces whose differences are known by construction."""
from __future__ import annotations

import json
import re

import pytest

from divergence import Trace
from divergence.analysis.bisect import bisect_traces
from divergence.analysis.diff import diff_traces
from divergence.cli.main import main

from .test_classify import BASE, write_trace

# tokens equal everywhere; the logits of step 3 differ in their last bit
DRIFT = dict(logits=[[2.0, 1.0]] * 3 + [[2.0000002, 1.0]] + [[2.0, 1.0]] * 2, kv=[10, 11, 12, 99, 14, 15],
             kernels=["gemv"] * 3 + ["gemm"] + ["gemv"] * 2)


@pytest.fixture
def drift(tmp_path):
    a = write_trace(tmp_path / "a.h5", **BASE)
    b = write_trace(tmp_path / "b.h5", **{**BASE, **DRIFT})
    return a, b


def test_logit_only_drift_is_identical_but_said_without_bitwise(drift, capsys):
    a, b = drift
    with Trace.open(a) as ta, Trace.open(b) as tb:
        d = diff_traces(ta, tb)
        r = d.requests[0]
        assert d.identical and r.status == "identical" and r.logits_only
        assert r.first_numeric_divergence.position == 6
    capsys.readouterr()
    assert main(["diff", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "r1  tokens identical (6 tokens); logits differ from position 6 (max |Δlogit| 2.38e-07)" in out
    assert "--bitwise counts it as diverged" in out


def test_bitwise_counts_logit_only_drift_as_diverged(drift, capsys):
    a, b = drift
    capsys.readouterr()
    assert main(["diff", str(a), str(b), "--bitwise", "--json"]) == 1
    r = json.loads(capsys.readouterr().out)["requests"][0]
    assert r["status"] == "diverged" and r["first_divergent_token"] is None
    assert r["first_numeric_divergence"]["position"] == 6
    assert main(["bisect", str(a), str(b), "--bitwise", "--json"]) == 1
    j = json.loads(capsys.readouterr().out)
    r = j["requests"][0]
    assert r["status"] == "diverged" and r["first_divergent_token"] is None
    # the write of step 3 (position 5, read by the row predicting position 6) is the cause
    assert r["root_cause"]["kind"] == "step_compute" and r["root_cause"]["step_b"] == 3
    assert r["root_cause"]["kernel_b"] == "gemm/1" and r["root_cause"]["kernel_a"] == "gemv"
    assert main(["bisect", str(a), str(b), "--bitwise"]) == 1
    out = capsys.readouterr().out
    assert "tokens identical (6 tokens), but logits differ from position 6" in out and "root cause" in out
    with Trace.open(a) as ta, Trace.open(b) as tb:
        assert bisect_traces(ta, tb).identical and not bisect_traces(ta, tb, bitwise=True).identical


def test_no_nan_when_the_chosen_token_is_outside_the_topk(tmp_path, capsys):
    """The stored top-2 is ids (5, 6); B samples token 7 at generated #3. A trace without
    the chosen token's own logit (this one) shows n/a, never nan."""
    a = write_trace(tmp_path / "a.h5", **BASE)
    b = write_trace(tmp_path / "b.h5", **{**BASE, "tokens": [5, 5, 5, 7, 7, 7]})
    capsys.readouterr()
    for cmd in (["diff"], ["bisect"]):
        assert main(cmd + [str(a), str(b)]) == 1
        out = capsys.readouterr().out
        assert not re.search(r"\bnan\b", out, re.I) and "n/a" in out
        assert main(cmd + [str(a), str(b), "--json"]) == 1
        text = capsys.readouterr().out
        assert not re.search(r"\bNaN\b", text)
        b_side = json.loads(text)["requests"][0]["first_divergent_token"]["b"]
        assert b_side["token"] == 7 and b_side["logit"] is None and b_side["margin"] is None
        assert b_side["runner_up"] == 5


@pytest.mark.parametrize("force, words", [
    ("9999:gemv", "has no step 9999 (steps 0-5)"),
    ("2:q_proj=gemv", "step 2 of"),  # the trace's model never ran q_proj
    ("2:frobnicate=gemv", "unknown op 'frobnicate'"),
    ("2:gemx", "unknown kernel policy 'gemx'"),
    ("2:k_proj=gemx", "unknown kernel policy 'gemx'"),
    ("x:gemv", "expected STEP:KERNEL"),
])
def test_forced_steps_are_checked_against_the_trace(drift, capsys, force, words):
    _, b = drift
    capsys.readouterr()
    assert main(["replay", str(b), "--force", force]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert "Traceback" not in captured.err and not captured.out
