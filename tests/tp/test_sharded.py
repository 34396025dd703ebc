"""TP=2 against an independent reference: mlx-lm's own sharded model (Model.shard under
the same group) run with generate_step, and the failure cases of --tp."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from divergence.parallel.launch import launch

from .conftest import ROOT, cli


def test_tp2_tokens_equal_mlx_lm_sharded(tmp_path, fixture_dir, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    out = tmp_path / "ranks.json"
    rc = launch([sys.executable, str(Path(__file__).with_name("rank_mlxlm.py")), str(out), str(fixture_dir),
                 "float32", "12"], 2)
    assert rc == 0
    got = json.loads(out.read_text())
    assert got["size"] == 2 and got["backend"] == "ring"
    assert got["ours"]["serial"] == got["mlx_lm"]
    assert got["ours"]["concurrent"] == got["mlx_lm"]
    assert all(len(t) == 12 for t in got["mlx_lm"].values())


def test_tp_not_dividing_heads_is_one_line_exit_2(tmp_path, fixture_dir):
    r = cli("run", "--model", fixture_dir, "--tp", "3", "--max-tokens", "2", "--out", tmp_path / "t")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--tp 3 does not divide" in lines[0], lines
    assert not (tmp_path / "t").exists()


def test_tp_zero_is_bad_input(tmp_path, fixture_dir):
    r = cli("run", "--model", fixture_dir, "--tp", "0", "--out", tmp_path / "t")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
