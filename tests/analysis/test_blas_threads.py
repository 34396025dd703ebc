"""OpenBLAS's thread count is part of fp32 numerics: a trace records it and a replay runs
under it, so a replay on a machine with more (or fewer) cores is still the recording."""
from __future__ import annotations

import json
import os
import shutil

import h5py
import pytest

from divergence import Trace
from divergence.analysis.replayer import Replayer
from divergence.engine.kernels.blas import blas_threads, using_blas_threads
from divergence.cli.main import main

pytestmark = [pytest.mark.blas,
              pytest.mark.skipif(blas_threads() is None or blas_threads() < 2 or (os.cpu_count() or 1) < 2,
                                 reason="needs OpenBLAS on 2+ threads (.ci/run installs it): the reference BLAS "
                                        "has no thread count")]


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


def _threads_change_products(trace, n: int) -> bool:
    """The probe, independent of the engine: does some linear product of the trace's model, at
    a row count one of its target steps ran, give other fp32 bits on n threads than on one?
    (Whether it does is a fact of the BLAS core: Haswell kernels split 8+ rows between
    threads; the small-matrix kernels of SkylakeX / Cooperlake run small products on one.)"""
    import mlx.core as mx
    import numpy as np

    from divergence.engine.model.loading import load_model

    loaded = load_model(trace.meta["model"]["path"], dtype="float32")
    layer = loaded.model.model.layers[0]
    weights = [m.weight for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.mlp.gate_proj,
                                  layer.mlp.down_proj, loaded.model.model.embed_tokens)]
    from divergence.core.names import MODELS

    target = MODELS.index("target")
    rows = sorted({int(r) for r, m in zip(trace.steps["rows"], trace.steps["model"]) if int(m) == target})
    for w in weights:
        for m in rows:
            x = mx.random.normal((m, w.shape[1]), key=mx.random.key(m))
            outs = []
            for threads in (1, n):
                with using_blas_threads(threads):
                    y = x @ w.T
                    mx.eval(y)
                    outs.append(np.array(y).view(np.uint32))
            if not np.array_equal(*outs):
                return True
    return False


def test_the_thread_count_changes_the_bits_where_the_probe_says_it_does(one_thread_trace, tmp_path):
    """The control: told the recording ran on this process's thread count, the replay
    computes the batched steps on those threads; its logits differ exactly where the
    thread count changes the model's products on this BLAS core (else it is still faithful)."""
    lied = _told_threads(one_thread_trace, tmp_path / "lied.h5", blas_threads())
    with Trace.open(lied) as t:
        differs = _threads_change_products(t, blas_threads())
        rep = Replayer().replay_to_file(t, tmp_path / "replayed.h5")
    assert rep.logits_equal == (not differs), (differs, rep.first_difference)


def test_diff_names_an_environment_that_differs(one_thread_trace, tmp_path, capsys):
    other = _told_threads(one_thread_trace, tmp_path / "other.h5", 4)
    capsys.readouterr()
    assert main(["diff", str(one_thread_trace), str(other), "--json"]) == 0  # the same tokens: identical
    assert json.loads(capsys.readouterr().out)["environment_differs"] == {"blas_threads": [1, 4]}
    main(["diff", str(one_thread_trace), str(other)])
    assert "environments differ (blas_threads 1 vs 4)" in capsys.readouterr().out
    assert main(["diff", str(one_thread_trace), str(one_thread_trace), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["environment_differs"] == {}
