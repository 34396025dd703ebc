"""TP=1 vs TP=2 on the fixture in fp32, and TP=2 serial vs concurrent: diff, bisect
--bitwise --confirm name the sharded ops and prove every request by replay at TP=2."""
from __future__ import annotations

import json

import pytest

from .conftest import cli

PROMPTS = [
    {"id": "a", "prompt": "Return the number of items in the"},
    {"id": "b", "prompt": "Open file and return a stream. Raise OSError upon failure.", "arrival": 1},
    {"id": "c", "prompt": "Convert a number or string to an integer, or return 0", "arrival": 2},
]


@pytest.fixture(scope="module")
def traces(tmp_path_factory, fixture_dir):
    d = tmp_path_factory.mktemp("tp")
    prompts = d / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    common = ["--model", fixture_dir, "--dtype", "float32", "--prompts", prompts, "--max-tokens", "8",
              "--policy", "threshold:4", "--ignore-eos"]
    for tp in (1, 2):
        r = cli("run", *common, "--tp", tp, "--out", d / f"tp{tp}", "--json")
        assert r.returncode == 0, r.stderr
    return d


def test_tp2_trace_records_shards_and_allreduces(traces):
    from divergence.trace.reader import Trace

    with Trace.open(traces / "tp2" / "serial.h5") as t, Trace.open(traces / "tp1" / "serial.h5") as t1:
        assert t.tp_degree == 2 and t1.tp_degree == 1
        tp = t.meta["settings"]["tp"]
        assert tp["backend"] == "ring" and tp["world"] == [["127.0.0.1"], ["127.0.0.1"]]
        ar = t.allreduces()
        layers = t1.meta["model"]["num_layers"]
        target_steps = sum(1 for p in t.iter_plans() if p.model == "target")
        assert set(ar["op"]) == {"o_proj", "down_proj"}
        assert len(ar["step"]) == 2 * layers * target_steps  # two per layer per step (no draft here)
        k = t.kernels(step=0)
        shapes = {str(o): (int(n), int(kk)) for o, n, kk in zip(k["op"], k["n"], k["k"])}
        k1 = t1.kernels(step=0)
        full = {str(o): (int(n), int(kk)) for o, n, kk in zip(k1["op"], k1["n"], k1["k"])}
        assert shapes["q_proj"] == (full["q_proj"][0] // 2, full["q_proj"][1])
        assert shapes["o_proj"] == (full["o_proj"][0], full["o_proj"][1] // 2)
        assert shapes["lm_head"] == full["lm_head"]
        assert len(t1.allreduces()["step"]) == 0


def test_tp1_vs_tp2_bisect_names_sharded_ops_and_confirms_every_request(traces):
    a, b = traces / "tp1" / "serial.h5", traces / "tp2" / "serial.h5"
    r = cli("bisect", a, b, "--bitwise", "--confirm", "--json")
    assert r.returncode == 1, r.stderr
    rep = json.loads(r.stdout)
    assert rep["tp_degrees"] == [1, 2]
    assert len(rep["requests"]) == len(PROMPTS)
    for req in rep["requests"]:
        assert req["status"] == "diverged" and req["first_numeric_divergence"] is not None, req["id"]
        tpc = req["root_cause"]["tensor_parallel"]
        assert tpc["sharded_to_all"] == ["o_proj", "down_proj"] and tpc["allreduce"]["count"] > 0
        assert req["confirmed"] is True, req["root_cause"]["confirm_detail"]
        assert "unsharded" in req["root_cause"]["confirm_detail"]
    text = cli("bisect", a, b, "--bitwise").stdout
    assert "tensor-parallel degrees differ: A TP=1, B TP=2" in text


def test_tp2_serial_vs_concurrent_bisected_and_confirmed(traces):
    a, b = traces / "tp2" / "serial.h5", traces / "tp2" / "concurrent.h5"
    r = cli("bisect", a, b, "--bitwise", "--confirm", "--json")
    rep = json.loads(r.stdout)
    diverged = [q for q in rep["requests"] if q["status"] == "diverged"]
    assert diverged, "threshold:4 batches several requests into gemm rows: something must differ"
    assert rep["tp_degrees"] == [2, 2]
    for q in diverged:
        assert q["root_cause"] is not None and q["root_cause"]["tensor_parallel"] is None
        assert q["confirmed"] is True, q["root_cause"]["confirm_detail"]


def test_replay_of_tp2_trace_is_faithful_and_unsharded_matches_tp1(traces, tmp_path):
    src = traces / "tp2" / "serial.h5"
    r = cli("replay", src, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["faithful"] is True
    from divergence.trace.reader import Trace

    with Trace.open(src) as t:
        steps = [int(s) for s in t.steps["index"]]
    out = tmp_path / "unsharded.h5"
    force = [f"--force={s}:unsharded" for s in steps]
    r = cli("replay", src, *force, "--out", out, "--json")
    assert r.returncode == 0, r.stderr
    d = cli("diff", traces / "tp1" / "serial.h5", out, "--bitwise", "--json")
    assert d.returncode == 0 and json.loads(d.stdout)["identical"] is True, d.stdout[-2000:]
    import numpy as np

    # KV rows are hashed whole (every rank's heads gathered): the unsharded replay's equal TP=1's
    with Trace.open(traces / "tp1" / "serial.h5") as a, Trace.open(out) as b:
        ha, hb = a.kv_hashes(), b.kv_hashes()
        assert len(ha["k_hash"]) and np.array_equal(ha["k_hash"], hb["k_hash"])
        assert np.array_equal(ha["v_hash"], hb["v_hash"])


def test_unsharded_on_a_one_device_trace_is_bad_input(traces):
    r = cli("replay", traces / "tp1" / "serial.h5", "--force", "0:unsharded")
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "nothing is sharded" in r.stderr


def test_browse_compares_tp1_with_tp2(traces):
    """The browser: the degrees side by side, in its title and in the analysis labels."""
    from divergence.tui.app import BrowseApp
    from divergence.tui.data.overview import meta_rows
    from divergence.tui.data.session import BrowseData

    d = BrowseData.open(traces / "tp1" / "serial.h5", traces / "tp2" / "serial.h5")
    try:
        rows = dict(meta_rows(d.traces))
        assert rows["tensor parallel"][0] == "TP=1 (one device)"
        assert rows["tensor parallel"][1].startswith("TP=2 · ring")
        assert "tensor-parallel degrees differ: TP=1 vs TP=2" in BrowseApp(d, analyse=False).sub_title
        d.analyse()
        assert not d.analysis_error and d.diff.tp_degrees == (1, 2) and d.diff.label_b.endswith("TP=2")
    finally:
        d.close()
