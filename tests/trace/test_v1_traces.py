"""The committed schema-1 pair (traces/v1, recorded by the demo with the v1 writer)
still opens, diffs, bisects and confirms with every later reader."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from divergence import Trace
from divergence.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
V1 = ROOT / "traces" / "v1"
FIXTURES = ROOT / "fixtures"


def test_v1_pair_opens():
    with Trace.open(V1 / "serial.h5") as s, Trace.open(V1 / "concurrent.h5") as c:
        for t in (s, c):
            assert t.schema_version == 1 and t.completed
            assert [r.id for r in t.requests] == ["r1", "r2", "r3", "r4"]
            k = t.kernels()
            assert np.array_equal(k["rows"], k["m"])  # v1 stored rows; later readers derive it
            plans = list(t.iter_plans())
            assert [p.index for p in plans] == t.steps["index"].tolist()
            assert sum(len(t.tokens(r.id).tokens) for r in t.requests) == 257
            assert t.live_kv("r1")["k_hash"].size > 0
        assert c.step_plan(8).rows == 158 and s.step_plan(8).rows == 4


def test_v1_pair_diffs_and_bisects(capsys):
    a, b = str(V1 / "serial.h5"), str(V1 / "concurrent.h5")
    assert main(["diff", a, b, "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert [r["status"] for r in d["requests"]] == ["diverged", "identical", "identical", "identical"]
    assert d["requests"][0]["first_divergent_token"]["position"] == 127
    assert main(["bisect", a, b, "--confirm", "--model", str(FIXTURES / "target"),
                 "--draft", str(FIXTURES / "draft"), "--json"]) == 1
    r1 = json.loads(capsys.readouterr().out)["requests"][0]
    rc = r1["root_cause"]
    assert (rc["kind"], rc["layer"], rc["step_b"], rc["rows_b"], rc["kernel_a"], rc["kernel_b"]) == \
           ("cache_contamination", 0, 8, 158, "gemv", "gemm/8")
    assert r1["confirmed"] is True
