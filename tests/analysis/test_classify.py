"""Classification on hand-built traces, where the cause is known by construction:
sampler, step_compute, cache_contamination; and the pair checks of diff."""
from __future__ import annotations

import numpy as np
import pytest

from divergence import Trace
from divergence.analysis.bisect import bisect_traces
from divergence.analysis.diff import check_comparable, diff_traces
from divergence.cli.main import main
from divergence.core.events import (
    KernelChoice, KvWrite, RunInfo, SeqSlice, StepEvent, StepPlan, TokenEvent,
)
from divergence.core.request import Request, Sampling
from divergence.errors import TraceMismatchError
from divergence.trace.writer import TraceWriter

PROMPT = (1, 2, 3)


def write_trace(path, *, tokens, logits, kv, kernels, steps=6, model_hash="h", prompt=PROMPT, sampling=Sampling(),
                complete=True):
    """One request decoding `steps` tokens, one per step. tokens[i], logits[i] (top-2),
    kv[i] (k hash of the write at step i), kernels[i] (kernel of step i)."""
    req = Request("r1", prompt, max_tokens=steps, sampling=sampling)
    w = TraceWriter(path, top_k=2)
    w.on_run_start(RunInfo("serial", "native", {"top_k": 2}, [req], {"weights_hash": model_hash, "dtype": "float32"},
                           None, {}, ()))
    for i in range(steps):
        start = len(prompt) - 1 + i if i else 0
        n = len(prompt) if i == 0 else 1
        plan = StepPlan(i, "target", (SeqSlice("r1", "prefill" if i == 0 else "decode", start, n, 0,
                                               (0,) * n, (n - 1,)),))
        for op in ("k_proj", "lm_head"):
            w.on_kernel(KernelChoice(i, "target", 0 if op == "k_proj" else 1, op, n, kernels[i], n, 4, 4, 1))
        h = np.array([kv[i]] * n, np.uint64)
        w.on_kv_write(KvWrite(i, "target", "r1", 0, start, n, h, h))
        # the stored top-2 is always ids (5, 6): a sampled token need not be the top-1
        w.on_token(TokenEvent(i, "r1", len(prompt) + i, tokens[i], 0, np.array([5, 6], np.int32),
                              np.array(logits[i], np.float32)))
        w.on_step(StepEvent(plan, 0.0))
        if not complete and i == steps // 2:
            w.flush()
            w.f.close()
            return path
    w.on_run_end(True)
    return path


BASE = dict(tokens=[5, 5, 5, 5, 5, 5], logits=[[2.0, 1.0]] * 6, kv=[10, 11, 12, 13, 14, 15],
            kernels=["gemv"] * 6)


def make_pair(tmp_path, **changes):
    a = write_trace(tmp_path / "a.h5", **BASE)
    b = write_trace(tmp_path / "b.h5", **{**BASE, **changes})
    return Trace.open(a), Trace.open(b)


def test_sampler(tmp_path):
    a, b = make_pair(tmp_path, tokens=[5, 5, 5, 6, 6, 6])
    with a, b:
        rep = bisect_traces(a, b)
        c = rep.causes["r1"]
        assert c.kind == "sampler"
        assert rep.diff.requests[0].first_numeric_divergence is None
        assert rep.diff.requests[0].first_divergent_token.position == 6


def test_step_compute(tmp_path):
    logits = [[2.0, 1.0]] * 3 + [[1.5, 1.6]] + [[2.0, 1.0]] * 2
    a, b = make_pair(tmp_path, tokens=[5, 5, 5, 6, 6, 6], logits=logits,
                     kernels=["gemv"] * 3 + ["gemm"] + ["gemv"] * 2)
    with a, b:
        c = bisect_traces(a, b).causes["r1"]
        assert c.kind == "step_compute"
        assert c.b.step == 3 and c.op == "lm_head"
        assert (c.a.kernel, c.b.kernel) == ("gemv", "gemm/1")


def test_cache_contamination(tmp_path):
    logits = [[2.0, 1.0]] * 2 + [[1.9, 1.0]] * 2 + [[1.5, 1.6]] * 2
    a, b = make_pair(tmp_path, tokens=[5, 5, 5, 5, 6, 6], logits=logits, kv=[10, 99, 12, 13, 14, 15],
                     kernels=["gemv", "gemm", "gemv", "gemv", "gemv", "gemv"])
    with a, b:
        rep = bisect_traces(a, b)
        c = rep.causes["r1"]
        assert c.kind == "cache_contamination"
        assert c.b.step == 1 and c.layer == 0 and c.positions == [3]
        assert (c.a.kernel, c.b.kernel) == ("gemv", "gemm/1")
        d = rep.diff.requests[0]
        assert d.first_numeric_divergence.position == 5 and d.first_numeric_divergence.tokens_before_flip == 2


def test_mismatched_traces_are_refused(tmp_path, capsys):
    a = write_trace(tmp_path / "a.h5", **BASE)
    for name, kw, what in (("m", {"model_hash": "other"}, "different models"),
                           ("p", {"prompt": (1, 2, 4)}, "different prompts"),
                           ("s", {"sampling": Sampling(0.8, 1.0, 1)}, "sampling")):
        b = write_trace(tmp_path / f"{name}.h5", **{**BASE, **kw})
        with Trace.open(a) as ta, Trace.open(b) as tb:
            with pytest.raises(TraceMismatchError, match=what):
                check_comparable(ta, tb)
        capsys.readouterr()
        assert main(["diff", str(a), str(b)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and what in err[0]


def test_incomplete_trace_is_compared_up_to_its_end(tmp_path, capsys):
    a = write_trace(tmp_path / "a.h5", **BASE)
    b = write_trace(tmp_path / "b.h5", **BASE, complete=False)
    with Trace.open(a) as ta, Trace.open(b) as tb:
        assert not tb.completed
        d = diff_traces(ta, tb)
        assert d.identical and d.requests[0].truncated and d.requests[0].compared == 4
    assert main(["diff", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "incomplete" in out
