"""Portable truth: a trace records its BLAS core, replays bit for bit under it from a process
whose own core is another, and a pair of one schedule made under two BLAS environments gets an
`environment` cause, found to the first op and confirmed by replaying B under A's environment.

Every run here is a child process (`python -m divergence`) started with the environment it
is about, so the results do not depend on the core this test process happens to run: the
pair is two kernel families this CPU can run (Haswell and an AVX-512 core where it has
AVX-512, else OpenBLAS and the reference BLAS)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from divergence import Trace
from divergence.engine.kernels.blas import blas_in_use
from divergence.core.host import runnable_cores

pytestmark = pytest.mark.skipif(not blas_in_use().startswith("OpenBLAS"),
                                reason="needs OpenBLAS (.ci/run installs libopenblas0-pthread): the reference "
                                       "BLAS has no cores to record or force")

CORES = runnable_cores()
WIDE = [c for c in ("SkylakeX", "Cooperlake") if c in CORES]
# (A's environment, B's environment): options of `divergence run`
PAIR = ((["--blas-core", "Haswell"], ["--blas-core", WIDE[0]]) if "Haswell" in CORES and WIDE
        else ((["--blas-core", CORES[0]] if CORES else []), ["--reference-blas"]))


def divergence(*args, env=None, check=True):
    """`python -m divergence ARGS` in a child process; (exit code, stdout, stderr)."""
    e = dict(os.environ)
    for k in ("OPENBLAS_CORETYPE", "DIVERGENCE_REEXEC", "DIVERGENCE_BLAS"):
        e.pop(k, None)
    e.update(env or {})
    done = subprocess.run([sys.executable, "-m", "divergence", *map(str, args)], capture_output=True, text=True,
                          env=e)
    if check and done.returncode not in (0, 1):
        raise AssertionError(f"divergence {' '.join(map(str, args))}: exit {done.returncode}\n{done.stderr}")
    return done.returncode, done.stdout, done.stderr


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The same requests under one schedule, in A's and in B's environment."""
    d = tmp_path_factory.mktemp("envpair")
    prompts = d / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t, "max_tokens": 10}) + "\n" for i, t in
                               enumerate(["Return the number of", "If the object is a string, return it"])))
    for name, opts in zip("ab", PAIR):
        args = ["run", "--policy", "native", "--dtype", "float32", "--schedules", "serial", "--prompts", prompts,
                "--out", d / name, "--json"]
        if "--reference-blas" in opts:
            args = ["--reference-blas"] + args
        else:
            args += opts
        divergence(*args)
    return d / "a" / "serial.h5", d / "b" / "serial.h5"


def test_a_trace_records_the_core_it_ran(pair):
    for path, opts in zip(pair, PAIR):
        with Trace.open(path) as t:
            env = t.meta["environment"]
        if "--blas-core" in opts:
            core = opts[opts.index("--blas-core") + 1]
            assert env["blas_core"] == core and core in env["blas_config"]
        else:
            assert env["blas"].startswith("reference") and env["blas_core"] is None


def test_a_trace_replays_bit_for_bit_from_a_process_whose_core_is_another(pair, tmp_path):
    a = pair[0]
    with Trace.open(a) as t:
        recorded = t.meta["environment"]["blas_core"]
    other = next((c for c in ["Prescott"] + CORES if c != recorded), None)
    rc, out, err = divergence("replay", a, "--out", tmp_path / "r.h5", "--json", env={"OPENBLAS_CORETYPE": other})
    rep = json.loads(out)
    assert rc == 0 and rep["faithful"] and rep["logits_equal"] and rep["kv_equal"], (rep, err)
    assert f"OPENBLAS_CORETYPE={recorded}" in err  # it said where it ran
    # in-process, under the other core, the replay refuses (typed) instead of reporting a false mismatch
    rc, _, err = divergence("replay", a, env={"OPENBLAS_CORETYPE": other, "DIVERGENCE_REEXEC": "1"}, check=False)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and f"core {recorded}" in err, err


def test_a_pair_across_environments_gets_an_environment_cause_confirmed_by_replay(pair):
    a, b = pair
    rc, out, err = divergence("bisect", a, b, "--bitwise", "--confirm", "--json")
    report = json.loads(out)
    assert rc == 1, err  # the environments change the fp32 bits of these products
    causes = [r for r in report["requests"] if r["status"] == "diverged"]
    assert causes
    for r in causes:
        c = r["root_cause"]
        assert c["kind"] == "environment" and c["step_a"] == c["step_b"], c
        assert set(c["env_diff"]) & {"blas_core", "blas"}, c["env_diff"]
        assert c["first_op"] is not None and c["first_op"]["max_abs_delta"] > 0, c
        assert r["confirmed"] is True and "bit for bit" in c["confirm_detail"], c["confirm_detail"]
    _, text, _ = divergence("bisect", a, b, "--bitwise", "--no-ops")
    assert "root cause: environment: the same step, with the same rows, computed other bits" in text


def test_an_environment_this_machine_cannot_run_is_one_line_and_exit_2(pair, tmp_path, capsys, monkeypatch):
    import h5py
    import shutil

    from divergence.cli.main import main

    from divergence.engine.kernels.blas import blas_core
    from divergence.core.host import CORE_FLAGS

    # a core other than this process's, which this CPU (as far as the check knows) lacks
    core = next(c for c in ("Cooperlake", "SkylakeX", "Haswell") if c != blas_core())
    told = tmp_path / "told.h5"
    shutil.copy(pair[0], told)
    with h5py.File(told, "r+") as f:
        env = json.loads(f["meta"].attrs["environment"])
        env["blas_core"] = core
        f["meta"].attrs["environment"] = json.dumps(env)
    import divergence.analysis.environment as environment

    lacks = sorted(CORE_FLAGS[core])[-1:]
    monkeypatch.setattr(environment, "missing_flags", lambda c, flags=None: frozenset(lacks))
    capsys.readouterr()
    assert main(["replay", str(told)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot run OpenBLAS's {core} kernels" in err[0], err
    monkeypatch.undo()  # this CPU's own flags again: a core name no table knows
    assert main(["run", "--blas-core", "NoSuchCore", "--out", str(tmp_path / "x")]) == 2
    assert "not an OpenBLAS core" in capsys.readouterr().err
