"""Reads from worker threads (what the TUI does), next to a writer's flush thread in
the same process and to a live writer in another process: no crash, no deadlock, and
every snapshot agrees with itself (no records of steps it cannot see, none missing)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np

from divergence import Trace
from divergence.trace.writer import TraceWriter

from .synthetic import emit_run

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _reads(t: Trace) -> dict:
    out = {"plans": [t.step_plan(int(i)) for i in t.steps["index"]]}
    for rid in ("r1", "r2"):
        rec = t.tokens(rid)
        out[rid] = (rec.tokens.tolist(), rec.topk_logits.tobytes(), t.live_kv(rid)["k_hash"].tolist())
    out["kernels"] = t.kernels()["kernel"].tolist()
    out["finish"] = t.finish_step("r1")
    out["draws"] = t.table("draws")["value"].size
    return out


def _run_threads(fn, n=6, timeout=120):
    errors, threads = [], []

    def wrap():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - report every failure
            errors.append(e)

    for _ in range(n):
        threads.append(threading.Thread(target=wrap, daemon=True))
        threads[-1].start()
    for th in threads:
        th.join(timeout)
    assert not any(th.is_alive() for th in threads), "a reader thread hung (deadlock?)"
    assert not errors, errors[0]


def test_worker_thread_reads_beside_a_writer_thread(tmp_path):
    done = tmp_path / "done.h5"
    with TraceWriter(done, top_k=4) as w:
        emit_run(w, steps=120)
    with Trace.open(done) as ref:
        expected = _reads(ref)
    with Trace.open(done) as shared:  # one Trace read from many threads at once, like the TUI's workers

        def read_shared():
            for _ in range(3):
                assert _reads(shared) == expected

        busy = TraceWriter(tmp_path / "busy.h5", top_k=4)
        writer = threading.Thread(target=lambda: emit_run(busy, steps=400), daemon=True)
        import divergence.trace.writer as W
        old, W.FLUSH_SECONDS = W.FLUSH_SECONDS, 0.0  # a flush per step: the flush thread is always busy
        try:
            writer.start()
            _run_threads(read_shared)
            writer.join(120)
        finally:
            W.FLUSH_SECONDS = old
        assert not writer.is_alive()
    with Trace.open(tmp_path / "busy.h5") as t:
        assert t.completed and t.num_steps == 400


LIVE = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from divergence.trace import writer as W
    from trace.synthetic import emit_run
    W.FLUSH_SECONDS = 0.0
    w = W.TraceWriter({path!r}, top_k=4)
    started = False
    def slow(step):
        global started
        if not started and w.durable_steps:  # the file exists once the first flush is on disk
            started = True
            print("started", flush=True)
        time.sleep(0.002)
    emit_run(w, steps=100000, end=False, on_step=slow)
""")


def _consistent(t: Trace) -> int:
    """Every visible step has its slices, kernels, tokens and KV writes; nothing beyond it."""
    steps = t.steps["index"]
    n = len(steps)
    assert steps.tolist() == list(range(n))
    sl = t.table("slices")
    per_step = np.bincount(sl["step"], minlength=n) if n else np.zeros(0, int)
    assert (per_step[:n] == t.steps["slice_count"]).all()
    assert len(t.kernels()["step"]) == 4 * n  # emit_run: 2 layers x 2 ops per step
    tok = t.table("tokens")
    assert np.array_equal(np.bincount(tok["step"], minlength=n)[:n], per_step[:n])
    assert tok["step"].size == 0 or tok["step"].max() < n
    for i in (0, n // 2, n - 1) if n else ():
        t.step_plan(i)
    return n


def test_live_reads_from_threads_while_another_process_writes(tmp_path):
    path = tmp_path / "live.h5"
    proc = subprocess.Popen([sys.executable, "-c", LIVE.format(tests=TESTS, path=str(path))],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "started"
        seen = []

        def follow():
            deadline = time.time() + 3
            with Trace.open(path) as t:
                while time.time() < deadline:
                    seen.append(_consistent(t))
                    t.refresh()
            with Trace.open(path) as t:  # fresh opens too
                seen.append(_consistent(t))

        _run_threads(follow, n=4)
        assert max(seen) > min(seen)  # the snapshots moved on while the run went
    finally:
        proc.kill()
        proc.wait()
