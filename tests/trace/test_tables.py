"""The table-driven schema: any table of schema.TABLES is appended generically and
read back generically, with defaults where a trace lacks a table or a column."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import h5py
import numpy as np
import pytest

from divergence import Trace
from divergence.core.events import KernelChoice, Routing, RunInfo, StepEvent, StepPlan, SeqSlice, TokenEvent
from divergence.trace import schema as S
from divergence.trace.writer import TraceWriter

from .synthetic import REQUESTS, emit_run, info

V1 = Path(__file__).resolve().parents[2] / "traces" / "v1" / "serial.h5"


def test_append_and_read_any_table(tmp_path):
    p = tmp_path / "t.h5"
    with TraceWriter(p, top_k=4) as w:
        w.on_run_start(info())
        w.append("draws", step=[0, 0, 1], request=["r1", "r2", "r1"], position=[3, 2, 4],
                 purpose=["sample", "accept", "residual"], value=np.array([0.25, 0.5, 0.125]))
        w.on_record("draws", step=1, request=1, position=3, purpose=3, value=0.75)  # scalars, codes as ints
        w.on_routing(Routing(0, "target", "r1", 1, 0, 2, np.array([[3, 1], [0, 2]], np.int32),
                             np.array([[0.6, 0.4], [0.9, 0.1]], np.float32), np.array([2, 1], np.int32),
                             np.array([0.1, 0.05], np.float32), np.array([7, 8], np.uint64)))
        w.append("allreduce", step=0, model="target", layer=0, op="o_proj", ranks=2, bytes=4096, backend="ring")
        w.append("kernels", step=0, model="target", layer=0, op="attention", kernel="batched", m=2, n=2, k=37,
                 kv_min=5)
        w.on_step(StepEvent(StepPlan(0, "target", (SeqSlice("r1", "prefill", 0, 3, 0, (1, 2, 3), (2,)),)), 0.1))
        w.on_step(StepEvent(StepPlan(1, "target", (SeqSlice("r1", "decode", 3, 1, 0, (7,), (0,)),)), 0.1))
        w.on_run_end(True)
    with Trace.open(p) as t:
        d = t.table("draws")
        assert d["request"].tolist() == [0, 1, 0, 1]
        assert d["purpose"].tolist() == ["sample", "accept", "residual", "draft"]
        assert d["value"].dtype == np.float64 and d["value"].tolist() == [0.25, 0.5, 0.125, 0.75]
        assert t.table("draws", raw=True)["purpose"].tolist() == [0, 1, 2, 3]
        assert d["token"].tolist() == [-1] * 4 and np.isnan(d["lo"]).all()  # columns no append gave
        assert t.has_table("draws") and t.has_table("kv/writes") and not t.has_table("nope")
        r = t.routing("r1")
        assert r["experts"].shape == (2, 2) and r["experts"].tolist() == [[3, 1], [0, 2]]
        assert r["scores"].dtype == np.float32 and r["position"].tolist() == [0, 1]
        assert t.table("routing")["choice_offset"].tolist() == [0, 2] and t.has_routing
        assert t.table("routing_choices")["expert"].tolist() == [3, 1, 0, 2]
        assert t.allreduces(0)["backend"].tolist() == ["ring"]
        a = t.table("allreduce")
        assert (a["op"][0], a["backend"][0], int(a["bytes"][0]), int(a["ranks"][0])) == ("o_proj", "ring", 4096, 2)
        k = t.kernels()
        assert (k["op"][0], k["kernel"][0], int(k["k"][0]), int(k["kv_min"][0])) == ("attention", "batched", 37, 5)
        assert k["rows"].tolist() == k["m"].tolist() == [2]  # derived: schema 2 does not store it
        assert int(k["splits"][0]) == 1 and int(k["expert"][0]) == -1  # the columns' defaults
        assert "rows" not in h5py.File(p, "r")["kernels"].dtype.names


def test_missing_tables_and_columns_read_as_defaults(tmp_path):
    with Trace.open(V1) as t:  # schema 1: no draws table, no tokens logit column
        d = t.table("draws")
        assert all(v.size == 0 for v in d.values()) and d["value"].dtype == np.float64
        assert not t.has_table("draws") and t.has_table("tokens") and t.has_table("kv_writes")
        assert t.table("routing", raw=True)["input_hash"].dtype == np.uint64 and not t.has_routing
        assert t.routing("r1")["experts"].shape == (0, 0) and t.allreduces()["op"].size == 0
        tok = t.table("tokens")
        assert np.isnan(tok["logit"]).all() and tok["logit"].size == 257
        assert t.table("kv/hashes")["k_hash"].size == t.kv_hashes()["k_hash"].size > 0  # schema-1 names work
    with pytest.raises(KeyError, match="no trace table"):
        Trace.open(V1).table("nope")


def test_event_fields_fill_columns_by_name(tmp_path):
    """An event type that grows a field named like a column fills it (what issue 14's logit/prob need)."""
    @dataclasses.dataclass
    class Tok(TokenEvent):
        entropy: float = 0.0  # not a column: ignored

    p = tmp_path / "t.h5"
    with TraceWriter(p, top_k=2) as w:
        w.on_run_start(info())
        w.on_token(Tok(0, "r1", 3, 5, 0, np.array([5, 1], np.int32), np.array([2.5, 1.0], np.float32), 2.5, 0.75, 1.5))
        w.on_token(TokenEvent(0, "r2", 2, 1, 0, np.array([1], np.int32), np.array([3.0], np.float32)))
        w.on_kernel(KernelChoice(0, "draft", 1, "q_proj", 3, "gemm", 3, 8, 8, 4))
        w.on_step(StepEvent(StepPlan(0, "target", ()), 0.0))
        w.on_run_end(True)
    with Trace.open(p) as t:
        tok = t.table("tokens")
        assert tok["logit"][0] == 2.5 and tok["prob"][0] == np.float32(0.75) and np.isnan(tok["logit"][1])
        assert tok["topk_ids"].tolist() == [[5, 1], [1, -1]]  # short top-k rows are padded
        k = t.kernels()
        assert (k["model"][0], k["op"][0], k["kernel"][0], int(k["splits"][0]), int(k["rows"][0])) == \
               ("draft", "q_proj", "gemm", 4, 3)


def test_bad_appends_fail_at_the_call(tmp_path):
    with TraceWriter(tmp_path / "t.h5") as w:
        w.on_run_start(info())
        with pytest.raises(KeyError, match="no trace table"):
            w.append("nope", x=1)
        with pytest.raises(KeyError, match="no column"):
            w.append("draws", bogus=1)
        with pytest.raises(ValueError, match="hash_offset"):
            w.append("kv_writes", step=0)
        w.on_run_end(True)


@pytest.mark.parametrize("background", [True, False])
def test_background_and_inline_flushes_write_the_same(tmp_path, background):
    ref, p = tmp_path / "ref.h5", tmp_path / "t.h5"
    with TraceWriter(ref, top_k=4, background=not background) as w:
        emit_run(w, steps=30)
    with TraceWriter(p, top_k=4, background=background) as w:
        emit_run(w, steps=30)
    with h5py.File(ref, "r") as a, h5py.File(p, "r") as b:
        for name in S.TABLES:
            assert np.array_equal(a[name][()], b[name][()], equal_nan=False) or \
                   a[name][()].tobytes() == b[name][()].tobytes(), name
    with Trace.open(p) as t:
        assert [r.id for r in t.requests] == [r.id for r in REQUESTS] and t.num_steps == 30


def test_widths_come_from_the_run(tmp_path):
    p = tmp_path / "t.h5"
    with TraceWriter(p, top_k=3) as w:
        w.on_run_start(RunInfo("serial", "native", {}, REQUESTS))
        w.on_run_end(True)
    with h5py.File(p, "r") as f:
        assert f["tokens"].dtype["topk_ids"].shape == (3,)


def test_table_storage_as_the_layout_promises(tmp_path):
    """Bodies: chunked, shuffled, gzip level 1 (kv_hashes: uncompressed), growable; tails: two uncompressed slots of
    a chunk's rows (layout.py makes them through h5py's low-level API)."""
    p = tmp_path / "t.h5"
    with TraceWriter(p, top_k=4) as w:
        w.on_run_start(info())
        w.on_run_end(True)
    with h5py.File(p, "r") as f:
        for name in S.TABLES:
            body, tail = f[name], f[S.TAILS][name]
            rows = max(16, S.CHUNK_BYTES // body.dtype.itemsize)
            assert body.dtype == tail.dtype and body.dtype.names
            assert (body.chunks, body.maxshape) == ((rows,), (None,))
            if name in S.UNCOMPRESSED:  # (hashes: incompressible)
                assert (body.compression, body.shuffle) == (None, False)
            else:
                assert (body.compression, body.compression_opts, body.shuffle) == ("gzip", 1, True)
            assert tail.shape == (2, rows) and tail.compression is None and not tail.shuffle
            assert tail.chunks == (1, max(1, rows // 8))
