"""A run killed with SIGKILL leaves a file that opens, marked incomplete, holding
every step the writer reported on disk before the kill (the flush thread may be
mid-write when it dies)."""
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
    from divergence.trace import writer as W
    from trace.synthetic import emit_run
    W.FLUSH_SECONDS = 0.0   # hand every step to the flush thread, so the child can report what is on disk
    w = W.TraceWriter({path!r}, top_k=4)
    def flushed(step):
        while w.durable_steps <= step:   # the writer says the step is on disk
            time.sleep(0.001)
        print(step, flush=True)
        time.sleep(0.02)
    emit_run(w, steps=100000, end=False, on_step=flushed)
""")


def test_sigkill_leaves_a_readable_incomplete_trace(tmp_path):
    path = tmp_path / "killed.h5"
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", CHILD.format(tests=tests, path=str(path))],
                            stdout=subprocess.PIPE, text=True)
    seen = -1
    deadline = time.time() + 60
    while seen < 20 and time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen = int(line)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert seen >= 20, "the child never got going"
    with Trace.open(path) as t:
        assert not t.completed
        assert t.num_steps >= seen + 1  # every step reported flushed is there
        plans = list(t.iter_plans())
        assert [p.index for p in plans] == list(range(len(plans)))
        assert len(t.tokens("r1").tokens) >= seen


FAST = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from divergence.trace import writer as W
    from trace.synthetic import emit_run
    W.FLUSH_SECONDS = 0.0   # a flush per step and no pause: a kill lands mid-write
    w = W.TraceWriter({path!r}, top_k=4)
    def first(step):
        if step == 0:
            w.flush()  # the file exists from here on
            print("started", flush=True)
    emit_run(w, steps=100000, end=False, on_step=first)
""")


def test_sigkill_mid_write_leaves_a_consistent_trace(tmp_path):
    from .test_threads import _consistent

    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for i, delay in enumerate((0.05, 0.3, 0.7)):
        path = tmp_path / f"killed{i}.h5"
        proc = subprocess.Popen([sys.executable, "-c", FAST.format(tests=tests, path=str(path))],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "started"
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        with Trace.open(path) as t:
            assert not t.completed
            _consistent(t)
