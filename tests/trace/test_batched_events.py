"""A step's events handed over as lists (on_kernels, on_kv_writes) record what the same
events one call each record; an Observer that only has the one-event methods gets each."""
from __future__ import annotations

import h5py
import numpy as np

from divergence.core.events import Observer
from divergence.trace import schema as S
from divergence.trace.writer import TraceWriter

from .synthetic import emit_run


class Lists:
    """Forwards every event to `target`, a step's kernel choices and KV writes as one list each."""

    def __init__(self, target):
        self.target, self.kernels, self.kv = target, [], []

    def on_kernel(self, c):
        self.kernels.append(c)

    def on_kv_write(self, w):
        self.kv.append(w)

    def _flush(self):
        if self.kernels:
            self.target.on_kernels(self.kernels)
        if self.kv:
            self.target.on_kv_writes(self.kv)
        self.kernels, self.kv = [], []

    def __getattr__(self, name):
        method = getattr(self.target, name)
        if not name.startswith("on_"):
            return method

        def call(*a, **k):
            self._flush()
            return method(*a, **k)
        return call


def test_lists_record_what_single_events_record(tmp_path):
    ref, p = tmp_path / "ref.h5", tmp_path / "t.h5"
    with TraceWriter(ref, top_k=4) as w:
        emit_run(w, steps=30)
    with TraceWriter(p, top_k=4) as w:
        emit_run(Lists(w), steps=30)
    with h5py.File(ref, "r") as a, h5py.File(p, "r") as b:
        assert b["kv_writes"].shape[0] > 0 and b["kernels"].shape[0] > 0
        for name in S.TABLES:
            assert a[name][()].tobytes() == b[name][()].tobytes(), name


def test_observer_gets_each_event_of_a_list():
    got = []

    class One(Observer):
        def on_kernel(self, c):
            got.append(("k", c))

        def on_kv_write(self, w):
            got.append(("kv", w))

    o = One()
    o.on_kernels([1, 2])
    o.on_kv_writes([3, np.uint64(4)])
    assert got == [("k", 1), ("k", 2), ("kv", 3), ("kv", np.uint64(4))]


class EachWrite:
    """Forwards every event to `target`, but a step's KV writes as KvWrite events (the engine
    gives them whole, as columns: StepKvWrites)."""

    def __init__(self, target):
        self.target = target

    def on_kv_writes(self, ws):
        self.target.on_kv_writes(list(ws))

    def __getattr__(self, name):
        return getattr(self.target, name)


def test_engine_kv_writes_as_columns_record_what_their_events_record(target, draft, tmp_path):
    """The engine's StepKvWrites (a prefill with draft and verify slices of several positions,
    decode steps of one each, a prefix hit's inherited writes as events among them) write the
    tables their KvWrite events write, byte for byte."""
    from divergence.core.events import StepKvWrites
    from divergence.core.request import Request
    from divergence.engine.engine import Engine
    from divergence.workloads.prompts import DEMO_R2_PROMPT

    base = target.encode(DEMO_R2_PROMPT)
    reqs = [Request(f"r{i}", tuple(base[: 40 + 9 * i]), max_tokens=10, arrival=3 * i) for i in range(3)]
    seen = []

    class Spy(Observer):
        def on_kv_writes(self, ws):
            seen.append(type(ws))

    paths = tmp_path / "whole.h5", tmp_path / "each.h5"
    for path, wrap in zip(paths, (lambda w: w, EachWrite)):
        with TraceWriter(path, top_k=8) as w:
            Engine(target, draft, policy="threshold:4", spec_k=2, stop_at_eos=False, prefix_caching=True,
                   observers=[wrap(w), Spy()]).run(reqs, "concurrent")
    assert StepKvWrites in seen and list in seen  # (a prefix hit's inherited writes: a list of events)
    with h5py.File(paths[0], "r") as a, h5py.File(paths[1], "r") as b:
        assert a["kv_writes"].shape[0] > 0
        for name in S.TABLES:
            if name != "steps":  # (durations)
                assert a[name][()].tobytes() == b[name][()].tobytes(), name
