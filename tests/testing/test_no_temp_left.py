"""Temporary directories: `bisect --confirm-cmd`, `replay` and a failing plugin check
leave no divergence-* directory behind in the temp dir (unless --keep)."""
from __future__ import annotations

import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from divergence.cli.main import main

EXAMPLE = Path(__file__).parents[2] / "examples" / "toy_engine.py"


@pytest.fixture
def tmp(tmp_path, monkeypatch):
    t = tmp_path / "tmp"
    t.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(t))
    return t


def _left(t):
    return sorted(p.name for p in t.iterdir() if p.name.startswith("divergence-"))


def test_bisect_confirm_cmd_and_replay_leave_nothing(tmp_path, tmp, capsys):
    for s in ("serial", "concurrent"):
        subprocess.run([sys.executable, str(EXAMPLE), "--schedule", s, "--out", str(tmp_path / s)], check=True)
        assert main(["import", str(tmp_path / s), "--out", str(tmp_path / f"{s}.h5")]) == 0
    cmd = f"{shlex.quote(sys.executable)} {shlex.quote(str(EXAMPLE))} --schedule concurrent --split-step {{step}} " \
          f"--out {{out}}"
    assert main(["bisect", str(tmp_path / "serial.h5"), str(tmp_path / "concurrent.h5"), "--confirm-cmd", cmd]) == 1
    assert "confirmed: re-running" in capsys.readouterr().out
    assert _left(tmp) == []
    assert main(["run", "--max-tokens", "4", "--out", str(tmp_path / "run"), "--json"]) in (0, 1)
    assert main(["replay", str(tmp_path / "run" / "concurrent.h5")]) == 0
    assert _left(tmp) == []
    assert main(["replay", str(tmp_path / "run" / "concurrent.h5"), "--keep"]) == 0
    assert [n.split("-")[1] for n in _left(tmp)] == ["replay"]


def test_a_failing_check_leaves_nothing(pytester, run, header, tmp):
    pytester.makepyfile(test_direct=header + """
from divergence.testing import assert_reproducible

def test_direct():
    assert_reproducible(None, PROMPTS, policy="threshold:1", max_tokens=FEW_TOKENS, confirm=False)
""")
    result = run()
    result.assert_outcomes(failed=1)
    assert _left(tmp) == []
