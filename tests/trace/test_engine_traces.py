"""Engine -> trace -> reader: what the engine emitted is read back equal, and two
runs of one schedule give identical traces (timings aside)."""
from __future__ import annotations

import numpy as np

from divergence import Trace
from divergence.engine.engine import Engine
from divergence.core.events import Observer
from divergence.core.request import Request
from divergence.trace.writer import TraceWriter


class Recorder(Observer):
    wants_kv_hashes = wants_kernels = wants_topk = True

    def __init__(self):
        self.tokens, self.kv, self.plans, self.kernels = [], [], [], []

    def on_token(self, e):
        self.tokens.append(e)

    def on_kv_write(self, w):
        self.kv.append(w)

    def on_step(self, e):
        self.plans.append(e.plan)

    def on_kernel(self, c):
        self.kernels.append(c)


def record(target, draft, path, schedule="concurrent"):
    reqs = [Request(f"r{i}", tuple(target.encode(p)), max_tokens=12, arrival=2 * i)
            for i, p in enumerate(["Return the number of", "This module provides", "Open file and"])]
    rec = Recorder()
    with TraceWriter(path, top_k=8) as w:
        Engine(target, draft, policy="threshold:4", spec_k=2, stop_at_eos=False, observers=[w, rec]).run(reqs, schedule)
    return rec


def test_engine_round_trip(target, draft, tmp_path):
    rec = record(target, draft, tmp_path / "t.h5")
    with Trace.open(tmp_path / "t.h5") as t:
        assert list(t.iter_plans()) == rec.plans
        assert {p.model for p in rec.plans} == {"target", "draft"}
        for rid in ("r0", "r1", "r2"):
            mine = sorted((e for e in rec.tokens if e.request_id == rid), key=lambda e: e.position)
            got = t.tokens(rid)
            assert got.tokens.tolist() == [e.token for e in mine]
            assert got.steps.tolist() == [e.step for e in mine]
            assert np.array_equal(got.topk_logits.view(np.uint32),
                                  np.stack([e.topk_logits for e in mine]).view(np.uint32))
        w, h = t.kv_writes(), t.kv_hashes()
        assert len(w["step"]) == len(rec.kv)
        for i, kv in enumerate(rec.kv):
            o = int(w["hash_offset"][i])
            assert np.array_equal(h["k_hash"][o: o + kv.count], kv.k_hashes)
        assert len(t.kernels()["step"]) == len(rec.kernels)


def test_two_runs_give_identical_traces(target, draft, tmp_path):
    record(target, draft, tmp_path / "a.h5")
    record(target, draft, tmp_path / "b.h5")
    with Trace.open(tmp_path / "a.h5") as a, Trace.open(tmp_path / "b.h5") as b:
        assert list(a.iter_plans()) == list(b.iter_plans())
        for rid in ("r0", "r1", "r2"):
            ta, tb = a.tokens(rid), b.tokens(rid)
            assert np.array_equal(ta.tokens, tb.tokens)
            assert np.array_equal(ta.topk_logits.view(np.uint32), tb.topk_logits.view(np.uint32))
        for k in ("k_hash", "v_hash"):
            assert np.array_equal(a.kv_hashes()[k], b.kv_hashes()[k])
        ka, kb = a.kernels(), b.kernels()
        assert all(np.array_equal(ka[c], kb[c]) for c in ("step", "layer", "op", "kernel", "splits"))
