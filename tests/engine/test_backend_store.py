"""BackendStore batches its writes: the first put writes, later ones wait for one write
(timer, flush, exit, or a store of this process reading the file), which merges what the
file holds by then; the file round-trips; a home it cannot write keeps the values in
memory; DIVERGENCE_PROOF_CACHE=off never touches the disk."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from divergence.core import atomic
from divergence.engine.kernels import backend_proofs as bp


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(bp.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(bp.OFF_ENV, raising=False)
    monkeypatch.setattr(bp, "FLUSH_AFTER_S", 3600.0)  # no timer fires during a test unless it asks
    written = []
    real = atomic.write_atomic

    def counted(path, data, **kw):
        # this test's stores' writes only: another store of the process (a proofs store an
        # earlier test left with a pending timer, whose home is elsewhere) may write meanwhile
        if Path(path).parent == tmp_path:
            written.append(path)
        return real(path, data, **kw)

    monkeypatch.setattr(atomic, "write_atomic", counted)
    return tmp_path, written


def _stored(path) -> dict:
    return json.loads(path.read_text())["test"]


def test_many_puts_write_once_until_flushed(cache):
    tmp, written = cache
    store = bp.BackendStore("test")
    for i in range(50):
        store.put(f"k{i}", i)
    assert len(written) == 1 and store.writes == 1  # the first put's
    (path,) = tmp.glob("test-*.json")
    assert _stored(path) == {"k0": 0}
    store.flush()
    assert len(written) == 2
    store.flush()  # nothing new: no write
    assert len(written) == 2
    assert _stored(path) == {f"k{i}": i for i in range(50)}
    again = bp.BackendStore("test")  # a later process reads them all
    assert [again.get(f"k{i}") for i in range(50)] == list(range(50))
    assert json.loads(path.read_text())["fingerprint"] == bp.fingerprint()


def test_the_timer_writes_the_rest(cache, monkeypatch):
    tmp, written = cache
    monkeypatch.setattr(bp, "FLUSH_AFTER_S", 0.05)
    store = bp.BackendStore("test")
    store.put("a", 1)
    store.put("b", 2)
    store.put("c", 3)
    timer = store._timer
    assert timer is not None and len(written) == 1
    timer.join(10)
    assert len(written) == 2 and store._timer is None
    assert _stored(next(tmp.glob("test-*.json"))) == {"a": 1, "b": 2, "c": 3}


def test_a_store_reading_the_file_gets_this_process_s_unwritten_values(cache):
    store = bp.BackendStore("test")
    store.put("a", 1)
    store.put("b", 2)  # not written yet
    assert bp.BackendStore("test").get("b") == 2


def test_a_write_merges_the_other_writer_s_keys(cache):
    tmp, _ = cache
    first = bp.BackendStore("test")
    first.put("a", 1)  # written
    other = bp.BackendStore("test")  # another process: loaded now
    assert other.get("a") == 1
    first.put("a2", 2)  # pending in first
    other.put("b", 3)  # other's first write: a, b
    first.flush()  # first's write keeps b
    assert _stored(next(tmp.glob("test-*.json"))) == {"a": 1, "a2": 2, "b": 3}
    assert first.get("b") == 3


def test_an_unwritable_home_keeps_values_in_memory(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(bp.CACHE_ENV, str(blocker / "cache"))  # a directory under a file: mkdir fails
    monkeypatch.delenv(bp.OFF_ENV, raising=False)
    store = bp.BackendStore("test")
    store.put("a", 1)
    store.put("b", 2)
    store.flush()
    assert store.get("a") == 1 and store.get("b") == 2 and store.writes == 0


def test_off_is_memory_only(cache, monkeypatch):
    tmp, written = cache
    monkeypatch.setenv(bp.OFF_ENV, "off")
    store = bp.BackendStore("test")
    for i in range(5):
        store.put(f"k{i}", i)
    store.flush()
    bp._flush_all()
    assert store.get("k4") == 4 and store._timer is None
    assert written == [] and not list(tmp.iterdir())


def _putter(cache, flush_after_s: float, n: int, key: str) -> tuple[str, dict]:
    """(code, env) of a child process that puts n keys (`key` an f-string of i and sys.argv)."""
    code = textwrap.dedent(f"""
        import os, sys
        os.environ[{bp.CACHE_ENV!r}] = {str(cache)!r}
        from divergence.engine.kernels import backend_proofs as bp
        bp.FLUSH_AFTER_S = {flush_after_s!r}
        s = bp.BackendStore("test")
        for i in range({n}):
            s.put(f"{key}", i)
    """)
    return code, {k: v for k, v in __import__("os").environ.items() if k != bp.OFF_ENV}


def test_exit_writes_what_is_pending(tmp_path):
    code, env = _putter(tmp_path, 3600.0, 20, "k{i}")
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    assert _stored(next(tmp_path.glob("test-*.json"))) == {f"k{i}": i for i in range(20)}


def test_concurrent_processes_leave_a_whole_file(tmp_path):
    code, env = _putter(tmp_path, 0.0, 40, "{sys.argv[1]}{i}")
    procs = [subprocess.Popen([sys.executable, "-c", code, tag], env=env) for tag in ("a", "b")]
    assert [p.wait() for p in procs] == [0, 0]
    got = _stored(next(tmp_path.glob("test-*.json")))  # parses: never a torn write
    mine = [{f"{t}{i}": i for i in range(40)} for t in ("a", "b")]
    assert any(m.items() <= got.items() for m in mine)  # the last writer's keys, whole
    assert not list(tmp_path.glob("*.tmp"))
