"""The assertions called directly: the failure text, traces compared as files or open
Traces, an Engine as the subject, more than two schedules, a cheap plugin import."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from divergence.testing import ReproducibilityError, assert_reproducible, assert_traces_equal

DIVERGING = ["This module provides regular expression", "The socket module provides", "Decode the object using the codec"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def diverged(tmp_path_factory):
    """One failed check under threshold:1 (confirmed by replay), its traces kept."""
    with pytest.raises(AssertionError) as e:
        assert_reproducible(None, DIVERGING, policy="threshold:1", max_tokens=MAX_TOKENS,
                            out_dir=tmp_path_factory.mktemp("diverged"))
    return e.value


def test_failure_text_names_the_token_the_step_and_the_proof(diverged):
    assert isinstance(diverged, ReproducibilityError)
    text = str(diverged)
    lines = text.splitlines()
    assert lines[0] == "serial and concurrent runs differ"
    assert "Diverged requests: 2 / 3 (r1, r3)" in lines
    assert any(line.startswith("r1  first divergent token at position ") for line in lines)
    assert any(line.strip().startswith("serial") and "margin" in line for line in lines)
    assert any(line.strip().startswith("root cause: ") for line in lines)
    assert any(line.strip().startswith("confirmed: replaying concurrent with step") for line in lines)
    s, c = diverged.traces["serial"], diverged.traces["concurrent"]
    assert Path(s).is_file() and Path(c).is_file()
    assert f"divergence bisect {s} {c} --confirm" in text
    report = diverged.report
    assert not report.identical and sorted(report.causes) == ["r1", "r3"]
    assert all(report.confirmations[rid].confirmed for rid in report.causes)


def test_traces_equal_on_paths_and_open_traces(diverged):
    from divergence import Trace

    s, c = diverged.traces["serial"], diverged.traces["concurrent"]
    with pytest.raises(AssertionError, match=r"Diverged requests: 2 / 3 \(r1, r3\)") as e:
        assert_traces_equal(s, c)
    assert "root cause: " in str(e.value) and "confirmed" not in str(e.value)  # no replay unless asked
    with Trace.open(s) as a, Trace.open(s) as b:
        report = assert_traces_equal(a, b)
    assert report.identical and len(report.diff.requests) == 3


def test_an_engine_is_run_as_configured_and_left_as_it_was(tmp_path):
    from divergence.engine.engine import Engine
    from divergence.engine.model.loading import load_model
    from divergence.fixtures import TARGET

    engine = Engine(load_model(TARGET), policy="batch-invariant", stop_at_eos=False)
    report = assert_reproducible(engine, [DIVERGING[0], engine.encode(DIVERGING[1])], max_tokens=8)
    assert report.identical and [r.id for r in report.diff.requests] == ["r1", "r2"]
    with pytest.raises(AssertionError, match="policy threshold:1"):
        assert_reproducible(engine, DIVERGING, policy="threshold:1", max_tokens=8, confirm=False,
                            out_dir=tmp_path)
    assert str(engine.policy) == "batch-invariant" and engine.observers == []


def test_speculative_decoding_uses_the_fixture_draft(tmp_path):
    report = assert_reproducible(None, DIVERGING[:2], policy="batch-invariant", spec_k=2, max_tokens=8,
                                 out_dir=tmp_path, keep=True)
    assert report.identical
    from divergence import Trace

    with Trace.open(tmp_path / "concurrent.h5") as t:
        assert t.meta["settings"]["spec_k"] == 2 and t.meta["draft"]["path"].endswith("draft")


def test_three_schedules_compare_against_the_first():
    reports = assert_reproducible(None, DIVERGING[:2], schedules=("serial", "concurrent", "warm"),
                                  policy="batch-invariant", max_tokens=8)
    assert set(reports) == {"concurrent", "warm"} and all(r.identical for r in reports.values())


@pytest.mark.parametrize("kwargs, error", [
    ({"prompts": []}, "prompts is empty"),
    ({"prompts": ["x", ""]}, "prompt #2 is an empty string"),
    ({"policy": "fast"}, "unknown kernel policy 'fast'"),
    ({"schedules": ("serial",)}, "two or more distinct schedules"),
    ({"schedules": ("serial", "batched")}, "unknown schedule 'batched'"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"model": "no/such/dir"}, "model directory not found: no/such/dir"),
])
def test_bad_arguments_are_input_errors(kwargs, error):
    from divergence.errors import DivergenceInputError

    args = {"model": None, "prompts": ["x"], **kwargs}
    with pytest.raises(DivergenceInputError, match=error):
        assert_reproducible(args.pop("model"), args.pop("prompts"), **args)


def test_importing_the_plugin_does_not_import_mlx():
    code = ("import sys, divergence.testing.plugin, divergence.testing.checker; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'h5py', 'numpy')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
