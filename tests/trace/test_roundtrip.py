"""What the engine emitted is what the reader returns, bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

from divergence import Trace
from divergence.trace.writer import TraceWriter

from .synthetic import REQUESTS, emit_run


def test_round_trip(tmp_path):
    path = tmp_path / "t.h5"
    with TraceWriter(path, top_k=4) as w:
        em = emit_run(w)
    with Trace.open(path) as t:
        assert t.completed and t.schema_version == 2
        assert t.meta["schedule"] == "concurrent" and t.meta["model"]["weights_hash"] == "abc"
        assert [(r.id, r.prompt_tokens, r.arrival, r.max_tokens, r.sampling) for r in t.requests] == \
               [(r.id, r.prompt_tokens, r.arrival, r.max_tokens, r.sampling) for r in REQUESTS]
        assert t.vocab == ["a", "b\x00", "ç", "d", "e", "f"]
        assert [t.step_plan(p.index) for p in em["plans"]] == em["plans"]
        assert list(t.iter_plans()) == em["plans"]
        for rid in ("r1", "r2"):
            mine = sorted((e for e in em["tokens"] if e.request_id == rid), key=lambda e: e.position)
            rec = t.tokens(rid)
            assert rec.positions.tolist() == [e.position for e in mine]
            assert rec.tokens.tolist() == [e.token for e in mine]
            assert rec.steps.tolist() == [e.step for e in mine]
            assert rec.spec.tolist() == [e.spec for e in mine]
            assert np.array_equal(rec.topk_ids, np.stack([e.topk_ids for e in mine]))
            assert np.array_equal(rec.topk_logits.view(np.uint32), np.stack([e.topk_logits for e in mine]).view(np.uint32))
        k = t.kernels()
        assert [(int(s), int(l), str(o), int(r), str(kn), int(sp)) for s, l, o, r, kn, sp in
                zip(k["step"], k["layer"], k["op"], k["rows"], k["kernel"], k["splits"])] == \
               [(c.step, c.layer, c.op, c.rows, c.kernel, c.splits) for c in em["kernels"]]
        writes = t.kv_writes()
        hashes = t.kv_hashes()
        assert len(writes["step"]) == len(em["kv"])
        for i, w in enumerate(em["kv"]):
            off = int(writes["hash_offset"][i])
            assert np.array_equal(hashes["k_hash"][off: off + w.count], w.k_hashes)
            assert np.array_equal(hashes["v_hash"][off: off + w.count], w.v_hashes)
        assert t.finish_step("r1") == 5


def test_live_kv_picks_the_write_after_a_rollback(tmp_path):
    from divergence.core.events import KvWrite, StepEvent, StepPlan, SeqSlice
    from .synthetic import info

    path = tmp_path / "t.h5"
    w = TraceWriter(path, top_k=4)
    w.on_run_start(info())

    def write(step, start, hashes):
        h = np.array(hashes, np.uint64)
        w.on_kv_write(KvWrite(step, "target", "r1", 0, start, len(h), h, h + np.uint64(1)))
        w.on_step(StepEvent(StepPlan(step, "target", (SeqSlice("r1", "verify", start, len(h), 0, (0,) * len(h)),)), 0.0))

    write(0, 0, [10, 11, 12, 13])   # verify writes 0..3
    write(1, 2, [22, 23])           # 2..3 were rejected and rewritten
    write(2, 3, [33])
    w.on_run_end(True)
    with Trace.open(path) as t:
        live = t.live_kv("r1", at_step=1)
        assert live["position"].tolist() == [0, 1, 2, 3]
        assert live["k_hash"].tolist() == [10, 11, 22, 23]
        assert live["step"].tolist() == [0, 0, 1, 1]
        assert t.live_kv("r1")["k_hash"].tolist() == [10, 11, 22, 33]
        assert t.live_kv("r1", at_step=0)["v_hash"].tolist() == [11, 12, 13, 14]
        assert t.live_kv("r2")["position"].size == 0


def test_a_flush_per_step_costs_no_file_space(tmp_path, monkeypatch):
    """Bodies get whole compressed chunks only: flushing every step gives the file (tail
    slots aside) one flush at the end gives (compressed chunks rewritten per flush grew it 7x)."""
    import h5py

    from divergence.trace import writer as W

    sizes = {}
    for every_step in (False, True):
        monkeypatch.setattr(W, "FLUSH_SECONDS", 0.0 if every_step else 1e9)
        p = tmp_path / f"{every_step}.h5"
        with TraceWriter(p, top_k=4) as w:
            emit_run(w, steps=400)
        with h5py.File(p, "r") as f:
            assert (f["commit"][1:, 1] == 0).all()  # closed: the tails moved into the bodies
            tails = sum(d.id.get_storage_size() for d in f["tails"].values())  # fixed: <= 2 chunks a table
            sizes[every_step] = p.stat().st_size - tails
            assert f["tokens"].shape[0] == 400 + 399 and f["tokens"].compression == "gzip"
        with Trace.open(p) as t:
            assert t.num_steps == 400 and len(t.tokens("r2").tokens) == 399
    assert sizes[True] <= sizes[False] * 1.1, sizes


def test_durable_steps_counts_the_closing_flush_once_committed(tmp_path, monkeypatch):
    """The closing hand-off's steps count as on disk only after close commits them."""
    from divergence.trace import writer as W

    for every_step in (False, True):
        monkeypatch.setattr(W, "FLUSH_SECONDS", 0.0 if every_step else 1e9)
        w = TraceWriter(tmp_path / f"{every_step}.h5", top_k=4)
        emit_run(w, steps=40, end=False)
        if not every_step:  # nothing handed off yet: nothing on disk
            assert w.durable_steps == 0
        w.on_run_end(True)
        assert w.durable_steps == 40
        with Trace.open(w.path) as t:
            assert t.num_steps == 40


def test_a_failed_close_does_not_count_its_steps_as_on_disk(tmp_path, monkeypatch):
    from divergence.trace import layout
    from divergence.trace import writer as W

    monkeypatch.setattr(W, "FLUSH_SECONDS", 1e9)  # one hand-off: the closing one
    w = TraceWriter(tmp_path / "t.h5", top_k=4)
    emit_run(w, steps=10, end=False)

    def broken(self):
        raise OSError("disk gone")

    monkeypatch.setattr(layout.TableFile, "finish", broken)
    from divergence.errors import TraceError

    with pytest.raises(TraceError, match="disk gone"):  # the typed one-line error, not the OSError
        w.on_run_end(True)
    assert w.durable_steps == 0
