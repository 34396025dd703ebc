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
