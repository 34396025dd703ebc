"""A rank that dies stops the run within seconds, with one line, keeping the steps
already written; a launch whose port was taken is retried on fresh ports."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from divergence.parallel import launch as tp_launch

from .conftest import ROOT


def _ranks(pid: int) -> dict[int, int]:
    """MLX_RANK -> pid of the launcher's children (Linux /proc)."""
    out = {}
    try:
        kids = [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return out
    for c in kids:
        try:
            env = Path(f"/proc/{c}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for e in env:
            if e.startswith(b"MLX_RANK="):
                out[int(e.split(b"=", 1)[1])] = c
    return out


def _steps(path: Path) -> int:
    """Committed steps of a trace being written (0 while it cannot be read yet)."""
    from divergence.trace.reader import Trace

    if not path.exists():
        return 0
    try:
        with Trace.open(path) as t:
            return t.num_steps
    except Exception:  # noqa: BLE001  (created but not yet readable)
        return 0


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the ranks through Linux /proc")
@pytest.mark.parametrize("victim", [1, 0])
def test_a_dead_rank_fails_the_run_in_seconds_and_keeps_written_steps(tmp_path, fixture_dir, victim):
    from divergence.trace.reader import Trace

    out = tmp_path / "t"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, "-m", "divergence", "run", "--model", str(fixture_dir), "--tp", "2",
                          "--max-tokens", "500", "--ignore-eos", "--schedules", "serial", "--out", str(out)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        partial = out / "serial.h5.partial"  # the run's own unique name, once it exists
        while time.monotonic() < deadline and p.poll() is None:  # until steps are on disk
            found = sorted(out.glob("serial.*.h5.partial")) if out.exists() else []
            if found:
                partial = found[0]
            if _steps(partial) >= 3:
                break
            time.sleep(0.2)
        ranks = _ranks(p.pid)
        assert set(ranks) == {0, 1}, (ranks, p.poll())
        os.kill(ranks[victim], signal.SIGKILL)
        killed = time.monotonic()
        _, err = p.communicate(timeout=60)
        took = time.monotonic() - killed
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 1
    assert took < 15, took
    lines = [ln for ln in err.splitlines() if "error" in ln]
    assert len(lines) == 1, err
    assert f"rank {victim} died (killed by SIGKILL)" in lines[0] and partial.name in lines[0], lines[0]
    assert "Traceback" not in err and "[ring]" not in err
    assert not (out / "serial.h5").exists()
    with Trace.open(partial) as t:
        assert t.num_steps > 0 and not t.completed


def test_a_taken_port_is_retried(tmp_path, monkeypatch):
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    real = tp_launch.free_ports
    calls = []

    def ports(n):
        calls.append(n)
        return [taken.getsockname()[1]] + real(n - 1) if len(calls) == 1 else real(n)

    monkeypatch.setattr(tp_launch, "free_ports", ports)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    script = ("import sys; from divergence.parallel.ranks import _as_rank\n"
              "class A: command = 'diff'\n"
              "A._run = staticmethod(lambda a: 0)\n"
              "sys.exit(_as_rank(A(), 2))\n")
    try:
        rc = tp_launch.launch([sys.executable, "-c", script], 2)
    finally:
        taken.close()
    assert rc == 0 and len(calls) >= 2


def test_nccl_ranks_get_mlx_launch_environment(tmp_path, monkeypatch):
    """divergence's own NCCL launch sets what `mlx.launch --backend nccl` sets (this
    machine has no GPUs: the environment is what can be checked here)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    env = tp_launch._rank_env(1, 2, tmp_path, "nccl", None, 4242)
    assert env["MLX_RANK"] == "1" and env["MLX_WORLD_SIZE"] == "2"
    assert env["NCCL_HOST_IP"] == "127.0.0.1" and env["NCCL_PORT"] == "4242"
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and "MLX_HOSTFILE" not in env
    monkeypatch.setenv("DIVERGENCE_TP_BACKEND", "gloo")
    with pytest.raises(ValueError):
        tp_launch.backend()
