"""`divergence browse` on bad input: exit 2, one line on stderr, no app, no traceback."""
from __future__ import annotations

import subprocess
import sys

import h5py
import numpy as np
import pytest

from divergence.tui import app as app_module
from divergence.tui.app import run_browser


@pytest.fixture
def no_app(monkeypatch):
    """Record that the app would start, without a terminal."""
    started = []
    monkeypatch.setattr(app_module.BrowseApp, "run", lambda self, *a, **k: started.append(self))
    return started


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("divergence browse: error: ")
    return lines[0]


def test_missing_file(tmp_path, capsys, no_app):
    assert run_browser(tmp_path / "nope.h5") == 2
    assert "no such trace" in _one_error_line(capsys)
    assert not no_app


def test_not_a_trace(tmp_path, capsys, no_app, story_pair):
    junk = tmp_path / "junk.h5"
    junk.write_bytes(np.random.default_rng(0).bytes(2048))
    assert run_browser(junk) == 2
    _one_error_line(capsys)
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["x"] = np.arange(3)
    assert run_browser(story_pair[0], other) == 2
    assert "not a divergence trace" in _one_error_line(capsys)
    assert run_browser(tmp_path) == 2  # a directory
    _one_error_line(capsys)
    assert not no_app


def test_traces_of_different_runs(capsys, no_app, story_pair, other_model_trace):
    assert run_browser(story_pair[0], other_model_trace) == 2
    assert "different models" in _one_error_line(capsys)
    assert not no_app


def test_good_input_starts_the_app(capsys, no_app, story_pair):
    assert run_browser(*story_pair) == 0
    assert run_browser(story_pair[0]) == 0
    assert len(no_app) == 2 and capsys.readouterr().err == ""


def test_cli_exit_code_and_no_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "divergence", "browse", str(tmp_path / "nope.h5")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert r.stderr.startswith("divergence browse: error: ") and "Traceback" not in r.stderr
