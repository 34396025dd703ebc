"""Range reads (trace/ranged.py): a large trace's per-request and per-step views read only the
rows they need, and give exactly what whole-table reads give. Checked on real runs (the demo:
speculative decoding; a prefix cache, whose inherited K/V writes break step order; warm; MoE
routing), on a trace still being written (rows in the tail slots), and by counting the records
each analysis reads (Trace.rows_read), not by timing."""
from __future__ import annotations

import json

import numpy as np
import pytest

from divergence import Trace
from divergence.analysis.pipeline import AnalysisOptions, analyze_pair
from divergence.cli.main import main
from divergence.trace import ranged
from divergence.trace.layout import read_commit
from divergence.trace.writer import TraceWriter

from .synthetic import emit_run

PREFIX_PROMPTS = [  # three share a long prefix (prefix-cache hits), one does not
    {"id": "p1", "prompt": "The module defines the following functions for working with files and directories in "
                           "the operating system, and the classes", "max_tokens": 10},
    {"id": "p2", "prompt": "The module defines the following functions for working with files and directories in "
                           "the operating system, and more", "max_tokens": 10, "arrival": 3},
    {"id": "p3", "prompt": "The module defines the following functions for working with files and directories in "
                           "the operating system", "max_tokens": 8, "arrival": 6},
    {"id": "p4", "prompt": "Return the number of items", "max_tokens": 8, "arrival": 1},
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("ranged")
    assert main(["run", "--out", str(d / "demo")]) in (0, 1)  # threshold:4, speculative: r1 diverges
    prompts = d / "prefix.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PREFIX_PROMPTS))
    assert main(["run", "--prompts", str(prompts), "--prefix-cache", "--schedules", "serial,concurrent,warm",
                 "--out", str(d / "prefix")]) in (0, 1)
    from divergence.testing.models import make_random_model

    moe = make_random_model(d / "moe-model", model_type="qwen3_moe", dtype="float32")
    assert main(["run", "--model", str(moe), "--policy", "threshold:4", "--max-tokens", "8",
                 "--out", str(d / "moe")]) in (0, 1)
    return d


def _views(path, *, large: bool, select: bool = False) -> dict:
    """Every per-request and per-step view of a trace, as bytes."""
    out = {}
    with Trace.open(path) as t:
        if select:
            t.select([r.id for r in t.requests])
        assert t.ranged == (large or select)
        for r in t.requests:
            tok = t.tokens(r.id)
            out["tokens", r.id] = [np.asarray(x).tobytes() for x in tok]
            out["finish", r.id] = t.finish_step(r.id)
            steps = sorted(set(tok.steps.tolist()))
            for model in ("target", "draft"):
                for at in steps[:: max(1, len(steps) // 4)] + [None]:
                    out["kv", r.id, model, at] = {k: v.tobytes() for k, v in t.live_kv(r.id, model=model,
                                                                                       at_step=at).items()}
                    if t.has_routing:
                        out["routing", r.id, model, at] = {k: np.asarray(v).tobytes() for k, v in
                                                           t.routing(r.id, model=model, at_step=at).items()}
        out["plans"] = list(t.iter_plans())
        steps = t.steps["index"].tolist()
        for i in steps[:: max(1, len(steps) // 40)] + steps[-1:]:
            out["plan", i] = t.step_plan(i)
            out["kernels", i] = {k: np.asarray(v).tobytes() for k, v in t.kernels(i).items()}
        out["has_routing"] = t.has_routing
    return out


def _same_views(path, monkeypatch):
    monkeypatch.setattr(ranged, "LARGE_BYTES", 1 << 60)
    whole = _views(path, large=False)
    chosen = _views(path, large=False, select=True)
    monkeypatch.setattr(ranged, "LARGE_BYTES", 0)
    large = _views(path, large=True)
    assert whole.keys() == large.keys() == chosen.keys()
    differ = [k for k in whole if not (whole[k] == large[k] == chosen[k])]
    assert not differ, differ[:5]
    return whole


@pytest.mark.parametrize("trace", ["demo/serial", "demo/concurrent", "prefix/concurrent", "prefix/warm",
                                   "moe/concurrent"])
def test_range_reads_give_the_whole_tables_views(runs, trace, monkeypatch):
    whole = _same_views(runs / f"{trace}.h5", monkeypatch)
    if trace.startswith("prefix"):  # the case range reads must handle apart: writes out of step order
        with Trace.open(runs / f"{trace}.h5") as t:
            assert (np.diff(t.kv_writes()["step"]) < 0).any()
    if trace.startswith("moe"):
        assert whole["has_routing"]


def test_a_trace_still_being_written(tmp_path, monkeypatch):
    """Rows past the last whole chunk live in a tail slot until the run closes: ranges read them too."""
    path = tmp_path / "open.h5"
    w = TraceWriter(path, top_k=4, background=False)
    try:
        emit_run(w, steps=9, end=False)
        w.flush()
        with Trace.open(path) as t:
            assert not t.completed
            _, commit = read_commit(t.f, refresh=True)
            assert any(tail for _, tail, _ in commit.values())  # rows in a tail slot
        _same_views(path, monkeypatch)
    finally:
        w.close(completed=True)


def _reads(pair, monkeypatch, ids=None) -> tuple[dict, dict]:
    """(records read per table, the bisect JSON) of a ranged bisect --bitwise (no replay)."""
    monkeypatch.setattr(ranged, "LARGE_BYTES", 0)
    with Trace.open(pair[0]) as a, Trace.open(pair[1]) as b:
        if ids is not None:
            a.select(ids)
            b.select(ids)
        report = analyze_pair(a, b, AnalysisOptions(bitwise=True, replay=False))
        rows = {}
        for t in (a, b):
            for name, n in t.rows_read.items():
                rows[name] = rows.get(name, 0) + n
        return rows, report.to_json()


def test_requests_reads_only_those_requests_rows(runs, monkeypatch):
    pair = runs / "demo" / "serial.h5", runs / "demo" / "concurrent.h5"
    monkeypatch.setattr(ranged, "GAP_ROWS", 0)  # read exactly the rows pointed at (no merging)
    every, full = _reads(pair, monkeypatch)
    some, part = _reads(pair, monkeypatch, ["r2"])
    [r2] = part["requests"]
    assert r2 == next(r for r in full["requests"] if r["id"] == "r2")  # the same analysis of r2
    assert r2["root_cause"] is not None  # (--bitwise: its logits differ) so its K/V were read
    total = {}
    with Trace.open(pair[0]) as a, Trace.open(pair[1]) as b:
        for t in (a, b):
            for name in ("tokens", "kv_writes", "kv_hashes", "kernels", "slices"):
                total[name] = total.get(name, 0) + len(t.table(name, raw=True)["step" if name != "kv_hashes"
                                                                                   else "k_hash"])
            mine = t.kv_writes()["request"] == t.request_index("r2")
            total["r2 hashes"] = total.get("r2 hashes", 0) + int(t.kv_writes()["count"][mine].sum())
    assert sum(some.values()) < sum(every.values()) < sum(total.values())
    assert some["tokens"] < total["tokens"]  # the steps r2 lived, not the table
    assert some.get("kernels", 0) < total["kernels"] and some.get("slices", 0) < total["slices"]
    assert 0 < some["kv_hashes"] <= total["r2 hashes"]  # r2's own K/V hashes at most


def test_whole_reads_count_every_row(runs, monkeypatch):
    """The count is of records really read: a small trace's first token read checks every table."""
    monkeypatch.setattr(ranged, "LARGE_BYTES", 1 << 60)
    with Trace.open(runs / "demo" / "concurrent.h5") as t:
        t.tokens("r1")
        assert t.rows_read["kv_hashes"] == len(t.kv_hashes()["k_hash"]) > 0
        assert t.rows_read["kernels"] == len(t.kernels()["step"]) > 0


@pytest.mark.parametrize("pair", [("prefix/serial", "prefix/concurrent"), ("prefix/serial", "prefix/warm"),
                                  ("moe/serial", "moe/concurrent")])
def test_bisect_ranged_is_bisect_whole(runs, pair, monkeypatch):
    a, b = (runs / f"{p}.h5" for p in pair)
    _, ranged_json = _reads((a, b), monkeypatch)
    monkeypatch.setattr(ranged, "LARGE_BYTES", 1 << 60)
    with Trace.open(a) as ta, Trace.open(b) as tb:
        whole_json = analyze_pair(ta, tb, AnalysisOptions(bitwise=True, replay=False)).to_json()
    assert ranged_json == whole_json
    assert any(r["root_cause"] for r in whole_json["requests"])  # something was bisected


def test_requests_option_bad_input(runs, capsys):
    a, b = runs / "demo" / "serial.h5", runs / "demo" / "concurrent.h5"
    for cmd in ("diff", "bisect"):
        capsys.readouterr()
        assert main([cmd, str(a), str(b), "--requests", "r1,nope"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "no request 'nope'" in err[0], err
    assert main(["bisect", str(a), str(b), "--requests", "r2", "--json"]) == 0  # r2's tokens are identical
    out = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in out["requests"]] == ["r2"] and out["selected"] == ["r2"]
