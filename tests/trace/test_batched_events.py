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


class EachKernel:
    """Forwards every event to `target`, but a step's kernel choices as KernelChoice events,
    one on_kernel call each (the engine gives them as rows: StepKernels)."""

    def __init__(self, target):
        self.target = target

    def on_kernels(self, cs):
        for c in cs:
            self.target.on_kernel(c)

    def __getattr__(self, name):
        return getattr(self.target, name)


def _kernels_both_ways(engine_of, reqs, tmp_path):
    from divergence.core.events import KernelChoice, StepKernels

    seen = []

    class Spy(Observer):
        wants_kernels = True

        def on_kernels(self, cs):
            seen.append(type(cs))
            assert all(type(c) is KernelChoice for c in cs)

    paths = tmp_path / "rows.h5", tmp_path / "each.h5"
    for path, wrap in zip(paths, (lambda w: w, EachKernel)):
        with TraceWriter(path, top_k=8) as w:
            engine_of([wrap(w), Spy()]).run(reqs, "concurrent")
    assert set(seen) == {StepKernels}
    with h5py.File(paths[0], "r") as a, h5py.File(paths[1], "r") as b:
        assert a["kernels"].shape[0] > 0
        for name in S.TABLES:
            if name != "steps":  # (durations)
                assert a[name][()].tobytes() == b[name][()].tobytes(), name
        return a["kernels"][()]


def test_engine_kernel_rows_record_what_their_events_record(target, draft, tmp_path):
    """The engine's StepKernels (gemm with split-K, gemv, attention, draft and verify steps)
    write the tables their KernelChoice events write, byte for byte."""
    from divergence.core.request import Request
    from divergence.engine.engine import Engine
    from divergence.workloads.prompts import DEMO_R2_PROMPT

    base = target.encode(DEMO_R2_PROMPT)
    reqs = [Request(f"r{i}", tuple(base[: 40 + 9 * i]), max_tokens=10, arrival=3 * i) for i in range(3)]
    rec = _kernels_both_ways(lambda obs: Engine(target, draft, policy="threshold:4", spec_k=2, stop_at_eos=False,
                                                observers=obs), reqs, tmp_path)
    kernels = S.CODE_TABLES["kernels"]
    assert {kernels[k] for k in set(rec["kernel"].tolist())} >= {"gemm", "gemv"}
    assert (rec["splits"] > 1).any() and (rec["kv_min"] > 0).any() and len(set(rec["model"].tolist())) == 2


def test_engine_expert_kernel_rows_record_what_their_events_record(random_model, prompts, tmp_path):
    """An MoE model's expert choices (KernelChoice events of the experts' kernels, turned into
    rows by the step's sink) among the rows, byte for byte."""
    from divergence.core.request import Request
    from divergence.engine.engine import Engine

    loaded = random_model("qwen3_moe", hidden_size=64, num_layers=2, num_experts=8, experts_per_token=2,
                          dtype="float32")
    reqs = [Request(f"r{i}", tuple(loaded.encode(p)[:12]), max_tokens=4) for i, p in enumerate(prompts[:3])]
    rec = _kernels_both_ways(lambda obs: Engine(loaded, policy="native", stop_at_eos=False, observers=obs), reqs,
                             tmp_path)
    assert (rec["expert"] >= 0).any()


def test_kernel_rows_are_kernel_choices_fields():
    from dataclasses import fields

    from divergence.core.events import KERNEL_ROW, KernelChoice, StepKernels

    assert ("step",) + KERNEL_ROW == tuple(f.name for f in fields(KernelChoice))
    c = KernelChoice(3, "target", 1, "q_proj", 8, "native", 8, 256, 256, 1, 77, kv_min=5)
    (d,) = StepKernels(3, [tuple(getattr(c, f) for f in KERNEL_ROW)])
    assert d == c and hash(d) == hash(c) and repr(d) == repr(c)
