"""A run killed with SIGKILL leaves a file that opens, marked incomplete, holding
every step committed before the kill; a long step does not hold back the ones before it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from divergence import Trace

CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from divergence.trace.writer import TraceWriter
    from trace.synthetic import emit_run
    w = TraceWriter({path!r}, top_k=4, flush_seconds={flush})
    def stepped(step):
        print(w.committed_steps, flush=True)  # steps a reader can see now
        if step == {stall}:
            time.sleep(60)  # a long forward pass: the timer thread must commit the steps before it
        time.sleep(0.002)
    emit_run(w, steps=100000, end=False, on_step=stepped)
""")


def _child(path, *, flush: float, stall: int = -1):
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = CHILD.format(tests=tests, path=str(path), flush=flush, stall=stall)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def _read_until(proc, until) -> list[int]:
    seen = []
    deadline = time.time() + 30
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(int(line))
        if until(seen):
            break
    return seen


def test_sigkill_leaves_a_readable_incomplete_trace(tmp_path):
    path = tmp_path / "killed.h5"
    proc = _child(path, flush=0.05)
    try:
        seen = _read_until(proc, lambda s: s[-1] >= 20)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert seen and seen[-1] >= 20, "the child never got going"
    with Trace.open(path) as t:
        assert not t.completed
        assert t.num_steps >= seen[-1]  # every step reported committed is there
        plans = list(t.iter_plans())
        assert [p.index for p in plans] == list(range(len(plans)))
        # whole steps only: every record belongs to a step the steps table holds
        last = plans[-1].index
        assert t.kernels()["step"].max() == last and t.kv_writes()["step"].max() == last
        assert len(t.tokens("r1").tokens) == len(plans)


def test_a_long_step_does_not_hold_back_closed_steps(tmp_path):
    path = tmp_path / "stalled.h5"
    proc = _child(path, flush=0.25, stall=30)
    try:
        seen = _read_until(proc, lambda s: len(s) > 30)  # step 30 closed, the child now sleeps
        time.sleep(0.8)  # > 2 x flush_seconds: the timer thread has committed step 30
        with Trace.open(path) as live:  # a reader while the writer runs (SWMR)
            assert not live.completed and live.num_steps == 31
            assert len(live.tokens("r1").tokens) > 0
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert len(seen) > 30
    with Trace.open(path) as t:
        assert not t.completed
        assert t.num_steps == 31
