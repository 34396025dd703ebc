"""OpenBLAS's thread count is part of fp32 numerics: a trace records it and a replay runs
under it, so a replay on a machine with more (or fewer) cores is still the recording."""
from __future__ import annotations

import json
import os
import shutil

import h5py
import pytest

from divergence import Trace
from divergence.analysis.replay import Replayer
from divergence.blas import blas_threads, using_blas_threads
from divergence.cli.main import main

pytestmark = pytest.mark.skipif(blas_threads() is None or blas_threads() < 2 or (os.cpu_count() or 1) < 2,
                                reason="needs OpenBLAS on 2+ threads (.ci/run installs it): the reference BLAS "
                                       "has no thread count")


def test_using_blas_threads_sets_and_restores():
    before = blas_threads()
    with using_blas_threads(1):
        assert blas_threads() == 1
    assert blas_threads() == before
    with using_blas_threads(None):
        assert blas_threads() == before


@pytest.fixture(scope="module")
def one_thread_trace(tmp_path_factory):
    out = tmp_path_factory.mktemp("blas1")
    with using_blas_threads(1):  # recorded as if on a one-core machine
        assert main(["run", "--dtype", "float32", "--schedules", "concurrent", "--out", str(out), "--json"]) == 0
    return out / "concurrent.h5"


def _told_threads(src, dst, n: int):
    """A copy of the trace at `src` whose environment says it ran on n BLAS threads."""
    shutil.copy(src, dst)
    with h5py.File(dst, "r+") as f:
        env = json.loads(f["meta"].attrs["environment"])
        env["blas_threads"] = n
        f["meta"].attrs["environment"] = json.dumps(env)
    return dst


def test_replay_runs_under_the_recorded_thread_count(one_thread_trace, tmp_path, capsys):
    capsys.readouterr()
    with Trace.open(one_thread_trace) as t:
        assert t.meta["environment"]["blas_threads"] == 1
        rep = Replayer().replay_to_file(t, tmp_path / "replayed.h5")  # this process: 2+ threads
    assert rep.faithful and rep.logits_equal and rep.kv_equal, rep.first_difference
    assert blas_threads() >= 2


def test_the_thread_count_changes_the_bits(one_thread_trace, tmp_path):
    """The control: told the recording ran on this process's thread count, the replay
    computes the batched steps another way and its logits differ."""
    lied = _told_threads(one_thread_trace, tmp_path / "lied.h5", blas_threads())
    with Trace.open(lied) as t:
        rep = Replayer().replay_to_file(t, tmp_path / "replayed.h5")
    assert not rep.logits_equal


def test_diff_names_an_environment_that_differs(one_thread_trace, tmp_path, capsys):
    other = _told_threads(one_thread_trace, tmp_path / "other.h5", 4)
    capsys.readouterr()
    assert main(["diff", str(one_thread_trace), str(other), "--json"]) == 0  # the same tokens: identical
    assert json.loads(capsys.readouterr().out)["environment_differs"] == {"blas_threads": [1, 4]}
    main(["diff", str(one_thread_trace), str(other)])
    assert "environments differ (blas_threads 1 vs 4)" in capsys.readouterr().out
    assert main(["diff", str(one_thread_trace), str(one_thread_trace), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["environment_differs"] == {}
