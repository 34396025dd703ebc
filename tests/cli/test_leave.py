"""The `divergence` command leaves with os._exit once main() returns (cli/leave.py): what a
normal exit does that matters still happens, in order, and the exit status is main()'s."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]

SCRIPT = r"""
import atexit, sys, threading, time
from pathlib import Path
out = Path(sys.argv[1])
def late():
    time.sleep(0.3)
    (out / "thread").write_text("joined")
threading.Thread(target=late).start()  # not a daemon: the exit waits for it
atexit.register(lambda: print("atexit ran", flush=False))  # buffered: the flush must come after
sys.argv = ["divergence", *sys.argv[2:]]
from divergence.cli.main import console
console()
print("not reached")
"""


def _run(tmp_path, *argv):
    return subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), *argv], capture_output=True, text=True,
                          cwd=tmp_path, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)


def test_threads_joined_atexit_run_output_flushed(tmp_path):
    p = _run(tmp_path, "diff", "--help")
    assert p.returncode == 0, p.stderr
    assert "usage: divergence diff" in p.stdout and p.stdout.rstrip().endswith("atexit ran")
    assert "not reached" not in p.stdout
    assert (tmp_path / "thread").read_text() == "joined"


def test_the_exit_status_is_mains(tmp_path):
    p = _run(tmp_path, "diff", str(tmp_path / "only-one.h5"))
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_backend_stores_are_written_at_exit(tmp_path):
    """A value put just before the end (its write waits on a timer) is on disk after it."""
    code = ("import os, sys; from divergence.engine.kernels import backend_proofs as b; "
            "s = b.BackendStore('leave-test'); s.put('a', 1); s.put('b', 2); "
            "from divergence.cli.leave import leave; leave(0)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "DIVERGENCE_CACHE_DIR": str(tmp_path)})
    assert p.returncode == 0, p.stderr
    (f,) = tmp_path.glob("leave-test-*.json")
    assert '"b": 2' in f.read_text()


def test_under_a_profiler_it_exits_normally():
    from divergence.cli.leave import leave

    sys.setprofile(lambda *a: None)
    try:
        with pytest.raises(SystemExit) as e:
            leave(3)
    finally:
        sys.setprofile(None)
    assert e.value.code == 3
