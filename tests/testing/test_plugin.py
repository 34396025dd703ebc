"""The plugin through pytest itself (pytester, in-process): pass, fail with the root
cause, artifacts, the marker on a parametrised test, ini keys and options, usage errors."""
from __future__ import annotations

import os

import pytest



def test_batch_invariant_passes_and_leaves_no_traces(pytester, run, header):
    pytester.makepyfile(test_ok=header + """
def test_ok(divergence_check):
    report = divergence_check(PROMPTS, policy="batch-invariant", max_tokens=FEW_TOKENS)
    assert report.identical and len(report.diff.requests) == 3
""")
    result = run("--divergence-artifacts=art")
    result.assert_outcomes(passed=1)
    assert not list((pytester.path / "art").rglob("*.h5"))


def test_divergence_fails_with_the_root_cause_and_keeps_both_traces(pytester, run, header):
    pytester.makepyfile(test_bad=header + """
import pytest

@pytest.mark.parametrize("policy", ["threshold:1"])
def test_bad(divergence_check, policy):
    divergence_check(PROMPTS, policy=policy, max_tokens=FEW_TOKENS)
""")
    result = run("--divergence-artifacts=art")
    result.assert_outcomes(failed=1)
    art = pytester.path / "art" / "test_bad.py__test_bad_threshold_1"
    result.stdout.fnmatch_lines([
        "E *divergence.testing.ReproducibilityError: serial and concurrent runs differ",
        "E *model * (policy threshold:1, max_tokens 8)",
        "E *Diverged requests: 1 / 3 (r1)",
        "E *r1  first divergent token at position * (generated #*)",
        "E *    serial  * runner-up * margin *",
        "E *    concurrent * runner-up *",
        "E *    root cause: *",
        "E *      * step *: * rows = r1 *kernel gemm*",
        "E *      * serial step *: * row*, kernel gemv",
        "E *    confirmed: replaying concurrent with step* makes r1 match serial*",
        "E *To reproduce:",
        f"E *    serial:      {art}/serial.h5",
        f"E *    concurrent:  {art}/concurrent.h5",
        f"E *    divergence bisect {art}/serial.h5 {art}/concurrent.h5 --confirm",
    ])
    out = result.stdout.str()
    for frame in ("assertions.py", "checker.py", "plugin.py"):  # __tracebackhide__: the report, not our frames
        assert frame not in out
    assert sorted(p.name for p in art.iterdir()) == ["concurrent.h5", "report.html", "serial.h5"]
    page = (art / "report.html").read_text()
    assert "root cause: cache contamination" in page and "confirmed by replay" in page


def test_direct_assertion_traces_are_copied_to_the_artifacts(pytester, run, header):
    pytester.makepyfile(test_direct=header + """
from divergence.testing import assert_reproducible

def test_direct(tmp_path):
    assert_reproducible(None, PROMPTS, policy="threshold:1", max_tokens=FEW_TOKENS, confirm=False, out_dir=tmp_path)
""")
    result = run("--divergence-artifacts", "out/ci")
    result.assert_outcomes(failed=1)
    art = pytester.path / "out" / "ci" / "test_direct.py__test_direct"
    result.stdout.fnmatch_lines(["E *Diverged requests: 1 / 3 (r1)", "*- divergence artifacts -*",
                                 f"{art}/serial.h5", f"{art}/concurrent.h5", f"{art}/report.html"])
    assert "confirmed" not in result.stdout.str()
    assert sorted(p.name for p in art.iterdir()) == ["concurrent.h5", "report.html", "serial.h5"]
    assert "not confirmed (run with --confirm" in (art / "report.html").read_text()


def test_marker_on_a_parametrised_test(pytester, run, header):
    pytester.makepyfile(test_marked=header + """
import pytest

@pytest.mark.parametrize("policy", ["batch-invariant", "threshold:1"])
@pytest.mark.reproducible(prompts=PROMPTS, max_tokens=FEW_TOKENS)
def test_serving(policy, divergence_check):
    assert divergence_check.report.identical  # the marker's check ran first
""")
    result = run("--no-divergence-confirm", "-rfE")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*_ test_serving?threshold:1? _*",
        "serial and concurrent runs differ",
        "model * (policy threshold:1, max_tokens 8)",
        "Diverged requests: 1 / 3 (r1)",
        "r1  first divergent token at position *",
    ])
    out = result.stdout.str()
    assert "confirmed" not in out and "Traceback" not in out


def test_ini_keys_are_the_defaults(pytester, run, header):
    from divergence.fixtures import TARGET

    os.symlink(TARGET, pytester.path / "tiny")  # divergence_model is relative to the ini file
    pytester.makeini("""
[pytest]
divergence_model = tiny
divergence_policy = batch-invariant
divergence_top_k = 3
divergence_max_tokens = 6
""")
    pytester.makepyfile(test_ini=header + """
from divergence import Trace
from divergence.engine.engine import Engine
from divergence.engine.model.loading import load_model

def settings(path):
    with Trace.open(path) as t:
        return t.meta["settings"]

def test_settings(divergence_check):
    report = divergence_check(PROMPTS[:2], keep=True)
    assert [r.compared for r in report.diff.requests] == [6, 6]
    s = settings(divergence_check.traces["concurrent"])
    assert (s["policy"], s["top_k"]) == ("batch-invariant", 3)

def test_an_engine_keeps_its_own_settings(divergence_check):
    engine = Engine(load_model("tiny"), policy="gemv", top_k=5)
    divergence_check(PROMPTS[:2], model=engine, keep=True)
    s = settings(divergence_check.traces["serial"])
    assert (s["policy"], s["top_k"]) == ("gemv", 5)
""")
    run().assert_outcomes(passed=2)


@pytest.mark.parametrize("line, message", [
    ("divergence_policy = fast", "ERROR: divergence: unknown kernel policy 'fast' (expected native | batch-invariant | threshold:N)"),
    ("divergence_top_k = 0", "ERROR: divergence: divergence_top_k must be an integer >= 1, got '0'"),
    ("divergence_model = no/such/dir", "ERROR: divergence: divergence_model: model directory not found: */no/such/dir"),
])
def test_bad_settings_are_a_usage_error(pytester, run, line, message):
    pytester.makeini(f"[pytest]\n{line}\n")
    pytester.makepyfile("def test_x():\n    pass\n")
    result = run()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_bad_artifacts_dir_is_a_usage_error(pytester, run, header):
    pytester.makefile(".txt", art="not a folder")
    pytester.makepyfile("def test_x():\n    pass\n")
    result = run("--divergence-artifacts=art.txt")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: divergence: --divergence-artifacts */art.txt exists and is not a directory"])


def test_bad_arguments_fail_with_one_clear_line(pytester, run, header):
    pytester.makepyfile(test_args="""
import pytest

def test_empty(divergence_check):
    divergence_check([])

def test_policy(divergence_check):
    divergence_check(["x"], policy="fastest")

def test_model(divergence_check):
    divergence_check(["x"], model="no/such/model")

@pytest.mark.reproducible(prompts=["x"], polcy="native")
def test_marker_typo():
    pass
""")
    result = run()
    result.assert_outcomes(failed=4)
    result.stdout.fnmatch_lines([
        "E *divergence.errors.PromptError: prompts is empty: give at least one prompt*",
        "E *divergence.errors.PolicyError: unknown kernel policy 'fastest' (expected *)",
        "E *divergence.errors.ModelLoadError: model directory not found: no/such/model",
        "divergence: @pytest.mark.reproducible: unknown argument(s) polcy (expected prompts, *)",
    ])
    out = result.stdout.str()
    assert "assertions.py" not in out and "checker.py" not in out


def test_bitwise_ini_key_fails_on_logit_only_drift(pytester, run, tmp_path):
    """Equal tokens, logits one ulp apart: passes by default, fails under `divergence_bitwise`
    (and `bitwise=True` per check), with the bitwise bisect in the reproduce lines."""
    from tests.analysis.test_bitwise import DRIFT
    from tests.analysis.test_classify import BASE, write_trace

    a = write_trace(tmp_path / "a.h5", **BASE)
    b = write_trace(tmp_path / "b.h5", **{**BASE, **DRIFT})
    pytester.makepyfile(test_drift=f"""
def test_default(divergence_check):
    divergence_check.traces_equal({str(a)!r}, {str(b)!r}, confirm=False)

def test_per_check(divergence_check):
    divergence_check.traces_equal({str(a)!r}, {str(b)!r}, confirm=False, bitwise=True)
""")
    result = run()
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*r1  tokens identical (6 tokens), but logits differ from position 6*",
                                 "*divergence bisect * --confirm --bitwise"])
    pytester.makeini("[pytest]\ndivergence_bitwise = true\n")
    run().assert_outcomes(failed=2)
