"""What the engine emitted is what the reader returns, bit for bit."""
from __future__ import annotations

import re
from pathlib import Path

import h5py
import numpy as np
import pytest

from divergence import Trace
from divergence.engine.events import KvWrite, RunInfo, SeqSlice, StepEvent, StepPlan, TokenEvent
from divergence.engine.request import Request
from divergence.trace import schema as S
from divergence.trace.writer import TraceWriter

from .synthetic import REQUESTS, VOCAB, emit_run, info


def _by_position(events, rid):
    return sorted((e for e in events if e.request_id == rid), key=lambda e: e.position)


@pytest.mark.parametrize("compact", [True, False])
def test_round_trip(tmp_path, compact):
    path = tmp_path / "deep" / "dir" / "t.h5"  # parents are created
    with TraceWriter(path, top_k=4, flush_seconds=0, compact=compact) as w:
        em = emit_run(w)
    with Trace.open(path) as t:
        assert t.completed and t.schema_version == S.SCHEMA_VERSION
        assert t.meta["schedule"] == "concurrent" and t.meta["policy"] == "threshold:4"
        assert t.meta["model"]["weights_hash"] == "abc" and t.meta["draft"] == {"path": "/d"}
        assert t.meta["settings"]["spec_k"] == 2 and t.meta["environment"]["mlx"] == "0.32.4"
        assert [(r.id, r.prompt_tokens, r.arrival, r.max_tokens, r.sampling) for r in t.requests] == \
               [(r.id, r.prompt_tokens, r.arrival, r.max_tokens, r.sampling) for r in REQUESTS]
        r1, r2 = t.requests
        assert (r1.status, r1.finish_reason, r1.finish_step) == ("finished", "length", 5)
        assert (r2.status, r2.finish_reason) == ("error", "prompt too long — ç")
        assert t.finish_step("r1") == 5 and t.request_index("r2") == 1
        assert t.vocab == VOCAB
        # plans: compositions, tokens and logit rows, draft steps included
        assert [t.step_plan(p.index) for p in em["plans"]] == em["plans"]
        assert list(t.iter_plans()) == em["plans"] and t.num_steps == len(em["plans"])
        assert t.steps["duration"].tolist() == [0.001 * (i + 1) for i in range(6)]
        assert t.steps["rows"].tolist() == [p.rows for p in em["plans"]]
        # tokens and top-k, bit for bit
        for rid in ("r1", "r2"):
            mine = _by_position(em["tokens"], rid)
            rec = t.tokens(rid)
            assert rec.positions.tolist() == [e.position for e in mine]
            assert rec.tokens.tolist() == [e.token for e in mine]
            assert rec.steps.tolist() == [e.step for e in mine]
            assert rec.spec.tolist() == [e.spec for e in mine]
            assert np.array_equal(rec.topk_ids, np.stack([e.topk_ids for e in mine]))
            assert rec.topk_logits.dtype == np.float32
            assert np.array_equal(rec.topk_logits.view(np.uint32),
                                  np.stack([e.topk_logits for e in mine]).view(np.uint32))
        # kernels, all and per step
        k = t.kernels()
        got = list(zip(k["step"].tolist(), k["model"], k["layer"].tolist(), k["op"], k["rows"].tolist(), k["kernel"],
                       k["m"].tolist(), k["n"].tolist(), k["k"].tolist(), k["splits"].tolist()))
        assert got == [(c.step, c.model, c.layer, c.op, c.rows, c.kernel, c.m, c.n, c.k, c.splits)
                       for c in em["kernels"]]
        assert t.kernels(step=2)["model"].tolist() == ["draft"] * 5 and len(t.kernels(step=99)["step"]) == 0
        # KV writes and their hashes
        wr, h = t.kv_writes(), t.kv_hashes()
        assert len(wr["step"]) == len(em["kv"])
        for i, kv in enumerate(em["kv"]):
            assert (wr["step"][i], wr["layer"][i], wr["start"][i], wr["count"][i]) == \
                   (kv.step, kv.layer, kv.start, kv.count)
            assert S.MODELS[wr["model"][i]] == kv.model and t.requests[wr["request"][i]].id == kv.request_id
            o = int(wr["hash_offset"][i])
            assert np.array_equal(h["k_hash"][o: o + kv.count], kv.k_hashes)
            assert np.array_equal(h["v_hash"][o: o + kv.count], kv.v_hashes)
    with h5py.File(path, "r") as f:  # self-describing, compressed once complete
        assert f["kernels"].attrs["codes:op"].tolist() == list(S.OPS)
        assert f["tokens"].attrs["field:topk_logits"].startswith("top-k raw logits")
        assert (f["kernels"].compression == "gzip") == compact
    assert [p.name for p in path.parent.iterdir()] == ["t.h5"]  # no temporary left behind


def test_topk_padding_and_cutting(tmp_path):
    path = tmp_path / "t.h5"
    with TraceWriter(path, top_k=4, flush_seconds=0) as w:
        w.on_run_start(info())
        w.on_token(TokenEvent(0, "r1", 3, 1, 0, np.array([1, 0], np.int32), np.array([2.5, 1.0], np.float32)))
        w.on_token(TokenEvent(0, "r2", 2, 5, 0, np.arange(6, dtype=np.int32), np.arange(6, dtype=np.float32)))
        w.on_step(StepEvent(StepPlan(0, "target", (SeqSlice("r1", "prefill", 0, 3, 0, (1, 2, 3), (2,)),)), 0.0))
        w.on_run_end(True)
    with Trace.open(path) as t:
        assert t.tokens("r1").topk_ids.tolist() == [[1, 0, -1, -1]]
        assert t.tokens("r1").topk_logits.tolist() == [[2.5, 1.0, -np.inf, -np.inf]]
        assert t.tokens("r2").topk_ids.tolist() == [[0, 1, 2, 3]]


def test_bulk_append_matches_events(tmp_path):
    """TraceWriter.append (tools, big synthetic traces) lands where events would."""
    path = tmp_path / "t.h5"
    with TraceWriter(path, top_k=2) as w:
        w.on_run_start(info())
        w.append("kv/writes", step=[0, 1], model=0, request=[0, 1], layer=0, start=[0, 0], count=[2, 1],
                 hash_offset=[0, 2])
        w.append("kv/hashes", k_hash=np.array([1, 2, 3], np.uint64), v_hash=np.array([4, 5, 6], np.uint64))
        w.on_kv_write(KvWrite(2, "target", "r1", 0, 1, 1, np.array([7], np.uint64), np.array([8], np.uint64)))
        w.on_step(StepEvent(StepPlan(2, "target", ()), 0.0))
        w.on_run_end(True)
    with Trace.open(path) as t:
        assert t.kv_writes()["hash_offset"].tolist() == [0, 2, 3]
        assert t.live_kv("r1")["k_hash"].tolist() == [1, 7]
        assert t.live_kv("r2")["v_hash"].tolist() == [6]


def test_incomplete_run_keeps_request_errors_drops_half_steps(tmp_path):
    path = tmp_path / "t.h5"
    with pytest.raises(RuntimeError):
        with TraceWriter(path, top_k=4) as w:
            emit_run(w, steps=3, end=False)
            w.on_kv_write(KvWrite(3, "target", "r1", 0, 9, 1, np.array([1], np.uint64), np.array([1], np.uint64)))
            raise RuntimeError("engine crashed mid-step")
    with Trace.open(path) as t:
        assert not t.completed and t.num_steps == 3
        assert t.kv_writes()["step"].max() == 2  # the half step's write is not there
        assert t.requests[1].status == "error"


def test_live_kv_picks_the_write_after_a_rollback(tmp_path):
    path = tmp_path / "t.h5"
    w = TraceWriter(path, top_k=4)
    w.on_run_start(info())

    def write(step, start, hashes, layer=0):
        h = np.array(hashes, np.uint64)
        w.on_kv_write(KvWrite(step, "target", "r1", layer, start, len(h), h, h + np.uint64(1)))
        w.on_step(StepEvent(StepPlan(step, "target", (SeqSlice("r1", "verify", start, len(h), 0, (0,) * len(h)),)),
                            0.0))

    write(0, 0, [10, 11, 12, 13])  # verify writes 0..3
    write(1, 2, [22, 23])  # 2..3 were rejected and rewritten
    write(2, 3, [33])
    write(3, 0, [40], layer=1)
    w.on_run_end(True)
    with Trace.open(path) as t:
        live = t.live_kv("r1", at_step=1)
        assert live["position"].tolist() == [0, 1, 2, 3]
        assert live["k_hash"].tolist() == [10, 11, 22, 23]
        assert live["step"].tolist() == [0, 0, 1, 1]
        full = t.live_kv("r1")
        assert list(zip(full["layer"].tolist(), full["position"].tolist(), full["k_hash"].tolist())) == \
               [(0, 0, 10), (0, 1, 11), (0, 2, 22), (0, 3, 33), (1, 0, 40)]
        assert t.live_kv("r1", at_step=0)["v_hash"].tolist() == [11, 12, 13, 14]
        assert t.live_kv("r2")["position"].size == 0
        assert t.live_kv("r1", model="draft")["position"].size == 0


def test_live_kv_equals_a_reference_on_random_writes(tmp_path):
    """Random writes (rollbacks, a prefix hit's older step, two writes of a cell in one
    step, draft writes) against a dict that replays them in order."""
    rng = np.random.default_rng(3)
    reqs = [Request(f"q{i}", (1,)) for i in range(3)]
    path = tmp_path / "t.h5"
    writes = []
    with TraceWriter(path, top_k=1, flush_seconds=0) as w:
        w.on_run_start(RunInfo("concurrent", "native", requests=reqs))
        for step in range(40):
            for _ in range(int(rng.integers(1, 6))):
                older = rng.random() < 0.1  # a prefix hit records the step that wrote the block
                count = int(rng.integers(1, 5))
                kw = KvWrite(int(rng.integers(0, step + 1)) if older else step, str(rng.choice(["target", "draft"])),
                             f"q{rng.integers(0, 3)}", int(rng.integers(0, 3)), int(rng.integers(0, 30)), count,
                             rng.integers(0, 2**64, count, dtype=np.uint64),
                             rng.integers(0, 2**64, count, dtype=np.uint64))
                w.on_kv_write(kw)
                writes.append(kw)
            w.on_step(StepEvent(StepPlan(step, "target", ()), 0.0))
        w.on_run_end(True)
    with Trace.open(path) as t:
        for rid in ("q0", "q1", "q2"):
            for model in ("target", "draft"):
                for at in (None, 0, 7, 25):
                    ref = {}
                    for kw in writes:  # in record order; the latest step wins, then the later record
                        if kw.request_id != rid or kw.model != model or (at is not None and kw.step > at):
                            continue
                        for j in range(kw.count):
                            cell = (kw.layer, kw.start + j)
                            if cell not in ref or kw.step >= ref[cell][0]:
                                ref[cell] = (kw.step, int(kw.k_hashes[j]), int(kw.v_hashes[j]))
                    live = t.live_kv(rid, model=model, at_step=at)
                    got = {(l, p): (s, k, v) for l, p, s, k, v in zip(*(live[c].tolist() for c in
                                                                        ("layer", "position", "step", "k_hash",
                                                                         "v_hash")))}
                    assert got == ref
                    assert sorted(got) == list(zip(live["layer"].tolist(), live["position"].tolist()))


def test_the_docs_h5py_snippet_runs(tmp_path):
    path = tmp_path / "traces" / "serial.h5"
    with TraceWriter(path, top_k=4) as w:
        em = emit_run(w)
    doc = (Path(__file__).parents[2] / "docs" / "trace-format.md").read_text()
    code = re.search(r"## Reading with plain h5py\s+```python\n(.*?)```", doc, re.S).group(1)
    ns = {}
    exec(code.replace("traces/serial.h5", str(path)), ns)
    mine = _by_position(em["tokens"], "r1")
    assert ns["tokens"].tolist() == [e.token for e in mine]
    assert np.array_equal(ns["topk_logits"].view(np.uint32), np.stack([e.topk_logits for e in mine]).view(np.uint32))
    assert ns["ops"] == list(S.OPS)
