"""A re-run counts as a confirmation only if it is B with only the forced change
(analysis.rerun_check): B's earlier steps (composition, kernels, K/V hashes), B's
schedule, the forced step split or on the kernel asked. Checked on the example engine
through --confirm-cmd (A's trace copied, a serial re-run, a re-run that also changes an
earlier step: each refused, with the first difference named; the fixing re-runs still
confirmed, in words read from the re-run's trace), and on this engine's own replay
(a replayer that drops the forcing, or replays A, or forces an earlier step too)."""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from divergence import Trace
from divergence.cli.main import main

EXAMPLE = Path(__file__).parents[2] / "examples" / "toy_engine.py"
PY = shlex.quote(sys.executable)
TOY = f"{PY} {shlex.quote(str(EXAMPLE))}"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("toy")
    for schedule in ("serial", "concurrent"):
        subprocess.run([sys.executable, str(EXAMPLE), "--schedule", schedule, "--out", str(d / schedule)],
                       check=True, timeout=120)
        assert main(["import", str(d / schedule), "--out", str(d / f"{schedule}.h5")]) == 0
    return d / "serial.h5", d / "concurrent.h5"


@pytest.fixture(autouse=True)
def _tmp(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def _confirm_cmd(pair, capsys, cmd):
    capsys.readouterr()
    assert main(["bisect", str(pair[0]), str(pair[1]), "--confirm-cmd", cmd, "--json"]) == 1
    r1 = json.loads(capsys.readouterr().out)["requests"][0]
    assert r1["root_cause"]["step_b"] == 3
    return r1["confirmed"], r1["root_cause"]["confirm_detail"]


@pytest.mark.parametrize("cmd, why", [
    # A's own trace: its tokens are A's, so the old check said "confirmed ... bit for bit"
    ("cp {serial} {out}", "its schedule is serial, concurrent's is concurrent"),
    (f"{TOY} --schedule serial --split-step {{step}} --out {{out}}", "its schedule is serial"),
    # the fix, and besides an earlier step run on another kernel
    (f"{TOY} --schedule concurrent --split-step {{step}} --force-kernel 2=mm/4 --out {{out}}",
     "step 2 ran kernel mm/4 for attn.q at layer 0, B's ran mv"),
    # asked to run the step on A's kernel, and it ran B's: the forcing did nothing
    (f"{TOY} --schedule concurrent --force-kernel {{step}}=mm/4 --out {{out}} # {{force}}",
     "step 3 ran kernel mm/4 for attn.q, as B did: the forcing was not applied"),
    (f"{TOY} --schedule concurrent --split-step 1 --out {{out}}",
     "step 3 ran r1 decode[10:11] + r2 prefill[0:6] in one forward pass on B's kernels: the command changed "
     "nothing there"),
])
def test_confirm_cmd_refuses_a_rerun_that_is_not_b_with_the_change(pair, capsys, cmd, why):
    confirmed, detail = _confirm_cmd(pair, capsys, cmd.replace("{serial}", shlex.quote(str(pair[0]))))
    assert confirmed is False, detail
    assert detail.startswith("not a valid re-run of concurrent: "), detail
    assert why.replace("concurrent's", "B's") in detail, detail


@pytest.mark.parametrize("args, did", [
    ("--split-step {step}", "step 3 split: r1, r2 each in its own forward pass"),
    ("--split-step {step} --split-requests {requests}", "step 3 split: r2, r1 each in its own forward pass"),
    ("--force-kernel {step}={force}", "step 3 run on kernel mv where B ran mm/4 (attn.q, attn.k, attn.v, attn.o, "
                                      "mlp.up, mlp.down)"),
    # {force} named but the step split: the sentence says what the re-run did, not "on kernel mv"
    ("--split-step {step} --out {out} # {force}", "step 3 split: r1, r2 each in its own forward pass"),
])
def test_fixing_reruns_are_confirmed_saying_what_they_did(pair, capsys, args, did):
    out = "" if "{out}" in args else " --out {out}"
    confirmed, detail = _confirm_cmd(pair, capsys, f"{TOY} --schedule concurrent {args}{out}")
    assert confirmed is True, detail
    assert detail.startswith(f"re-running concurrent with {did} (--confirm-cmd) makes r1 match serial"), detail
    assert "on kernel mv" not in detail or "force-kernel" in args


def test_check_rerun_directly(pair, tmp_path):
    from divergence.analysis.rerun_check import Kernels, Split, check_rerun

    out = tmp_path / "split"
    subprocess.run([sys.executable, str(EXAMPLE), "--schedule", "concurrent", "--split-step", "3", "--out", str(out)],
                   check=True, timeout=120)
    assert main(["import", str(out), "--out", str(tmp_path / "split.h5")]) == 0
    with Trace.open(pair[1]) as b, Trace.open(tmp_path / "split.h5") as r, Trace.open(pair[0]) as a:
        ok = check_rerun(b, r, 3, Split(None))
        assert ok.valid and ok.first_difference is None and ok.did.startswith("step 3 split"), ok
        # split, where the kernel alone was asked: that is not what was asked
        no = check_rerun(b, r, 3, Kernels({"attn.q": "mv"}))
        assert not no.valid and "split into 2 forward passes" in no.first_difference, no
        assert check_rerun(b, b, 3, Split(None)).first_difference == (
            "step 3 ran r1 decode[10:11] + r2 prefill[0:6] in one forward pass, as B did: the forcing was not applied")
        assert check_rerun(b, a, 3, Split(None)).first_difference == "its schedule is serial, B's is concurrent"


# -- this engine's own replay ---------------------------------------------------------------

@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """Seed 000 on the fixtures (threshold:4, speculative): r1's cause is concurrent step 8."""
    out = tmp_path_factory.mktemp("demo")
    assert main(["run", "--out", str(out), "--json"]) == 0
    return out / "serial.h5", out / "concurrent.h5"


def _engine_confirm(demo, capsys):
    capsys.readouterr()
    assert main(["bisect", str(demo[0]), str(demo[1]), "--confirm", "--no-ops", "--json"]) == 1
    r1 = next(r for r in json.loads(capsys.readouterr().out)["requests"] if r["id"] == "r1")
    assert r1["root_cause"]["step_b"] == 8
    return r1["confirmed"], r1["root_cause"]["confirm_detail"]


def _patch_run(monkeypatch, change):
    from divergence.analysis.replayer import Replayer

    real = Replayer.run

    def run(self, trace, *, forced=None, **kw):
        trace, forced = change(trace, dict(forced or {}))
        return real(self, trace, forced=forced, **kw)

    monkeypatch.setattr(Replayer, "run", run)


def test_own_replay_is_checked_too(demo, capsys, monkeypatch):
    confirmed, detail = _engine_confirm(demo, capsys)
    assert confirmed is True and "step 8 run on serial's kernels" in detail, detail

    _patch_run(monkeypatch, lambda t, f: (t, {}))  # a replayer that drops the forcing
    confirmed, detail = _engine_confirm(demo, capsys)
    assert confirmed is False, detail
    assert detail == ("not a valid re-run of concurrent: step 8 ran kernel gemm/4 for q_proj, as B did: the forcing "
                      "was not applied"), detail


def test_own_replay_of_a_or_with_an_earlier_step_changed_is_refused(demo, capsys, monkeypatch):
    a = Trace.open(demo[0])
    try:
        _patch_run(monkeypatch, lambda t, f: (a, {}))  # replays A instead of B
        confirmed, detail = _engine_confirm(demo, capsys)
        assert confirmed is False and detail == "not a valid re-run of concurrent: its schedule is serial, B's is " \
                                                "concurrent", detail
    finally:
        a.close()
    from divergence.core.policy import KernelPolicy

    monkeypatch.undo()
    gemm = KernelPolicy.parse("gemm:2")
    _patch_run(monkeypatch, lambda t, f: (t, {**f, 4: gemm} if f else f))  # and step 4 on gemm besides
    confirmed, detail = _engine_confirm(demo, capsys)
    assert confirmed is False, detail
    assert detail == ("not a valid re-run of concurrent: step 4 ran kernel gemm/2 for q_proj at layer 0, B's ran "
                      "gemv"), detail
