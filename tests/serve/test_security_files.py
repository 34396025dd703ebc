"""The server's traces hold its users' prompts: every live trace (rotated ones too) and every
re-run of one is mode 0600 from its creation, whatever the umask; a directory the server
creates is 0700, one that exists keeps its mode."""
from __future__ import annotations

import os
import stat
from contextlib import contextmanager
from pathlib import Path

import httpx

from divergence.core.events import RunInfo
from divergence.trace.writer import TraceWriter

from .conftest import divergence, openai_client, start_server, trace_of

OK = {"model": "target", "prompt": "def add(a, b):\n    ", "max_tokens": 3}


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


@contextmanager
def _umask(mask: int):
    """The process's umask (a server started inside inherits it): 0 makes every file the
    umask decides world-readable and writable."""
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _files(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file())


def test_the_writer_creates_a_trace_with_its_mode_and_without_it_the_umasks(tmp_path):
    with _umask(0):
        for name, mode, want in (("private.h5", 0o600, 0o600), ("plain.h5", None, 0o666)):
            with TraceWriter(tmp_path / name, background=False, mode=mode) as w:
                w.on_run_start(RunInfo(schedule="serial", policy="native", requests=[]))
                w.on_run_end(True)
            assert _mode(tmp_path / name) == want, name
    assert [p.name for p in _files(tmp_path)] == ["plain.h5", "private.h5"]  # no temporary left


def test_live_traces_rotated_ones_and_their_rerun_are_0600_in_a_directory_kept_as_it_was(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)  # the user's choice: neither loosened nor tightened
    with _umask(0):
        s = start_server(tmp_path, "--trace-dir", str(shared), "--rotate-mb", "0.000001", "--ignore-eos")
    try:  # one request from the official client, one raw
        assert openai_client(s).completions.create(**OK).usage.completion_tokens == 3
        assert httpx.post(s.base_url + "/completions", json=OK, timeout=120).status_code == 200
    finally:
        assert s.stop() == 0
    live = sorted(shared.glob("live-*.h5"))
    assert len(live) >= 2  # rotated
    assert {p.name: _mode(p) for p in _files(shared)} == {p.name: 0o600 for p in live}
    assert _mode(shared) == 0o755
    with trace_of(live[0]) as t:
        assert t.requests  # a trace of a prompt, readable by its owner
    with _umask(0):
        r = divergence("rerun", str(live[0]), "--out", str(tmp_path / "rerun" / "new"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert [(p.name, _mode(p)) for p in _files(tmp_path / "rerun")] == [("serial.h5", 0o600)]
    assert _mode(tmp_path / "rerun") == _mode(tmp_path / "rerun" / "new") == 0o700


def test_mlx_lm_engine_live_trace_and_its_rerun_are_0600_in_new_directories_0700(tmp_path):
    where = tmp_path / "made" / "live"
    with _umask(0):
        s = start_server(tmp_path, "--engine", "mlx-lm", "--trace-dir", str(where))
    try:
        assert httpx.post(s.base_url + "/completions", json=OK, timeout=120).status_code == 200
    finally:
        assert s.stop() == 0
    [live] = where.glob("live-*.h5")
    assert [(p.name, _mode(p)) for p in _files(tmp_path / "made")] == [(live.name, 0o600)]
    assert _mode(where) == _mode(where.parent) == 0o700
    with _umask(0):
        r = divergence("rerun", str(live), "--out", str(tmp_path / "rerun"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert [(p.name, _mode(p)) for p in _files(tmp_path / "rerun")] == [("serial.h5", 0o600)]
    assert [p.name for p in (tmp_path / "rerun").iterdir()] == ["serial.h5"]  # its private directory gone
