"""Start N tensor-parallel ranks on this machine and watch them: `divergence run --tp N`
needs no extra command. Imports neither mlx nor the engine (the parent is no rank).

Ranks join over MLX's ring backend on 127.0.0.1 (free ports from the OS; a launch
whose ranks cannot connect is retried on new ports), each with MLX_RANK and
MLX_HOSTFILE as mlx.launch would set them; with DIVERGENCE_TP_BACKEND=nccl, over
NCCL, one GPU per rank (NCCL_HOST_IP / NCCL_PORT / MLX_WORLD_SIZE /
CUDA_VISIBLE_DEVICES, as `mlx.launch --backend nccl` sets them). With NCCL a
survivor does not notice a dead peer (it waits in the collective): the grace
period's kill is what stops it. Rank 0's stdout is this process's; its
stderr is forwarded without the ring's own per-socket messages; other ranks' output
goes to files shown on failure. A rank that dies stops the whole group within
seconds: the survivors see the ring connection drop and stop by themselves (rank 0
closes its trace, keeping every step it wrote), and whoever is still alive after a
grace period is killed, so a run never hangs. The failure is one line on stderr.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..core.host import CPU_SPLIT_ENV, usable_cores
from .env import backend, rank_env

# exit codes a rank uses beyond the CLI's 0/1/2/130
PEER_LOST = 75  # a collective failed: another rank is gone
CRASHED = 70  # an unexpected exception inside a rank
READY_TIMEOUT = 120.0  # seconds for all ranks to connect (loading MLX on a busy machine)
GRACE = 5.0  # seconds survivors get to stop by themselves once one rank failed
POLL = 0.05
RETRIES = 3  # launches on fresh ports when the ranks could not connect


class LaunchFailed(Exception):
    """The ranks could not all connect (e.g. a port was taken): retry elsewhere."""


def free_ports(n: int) -> list[int]:
    """n distinct ports the OS says are free now (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent() -> None:  # runs in the child before exec (Linux): no orphaned ranks
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def launch(command: list[str], n: int, *, label: str = "divergence", env: dict | None = None,
           kept=None) -> int:
    """Run `command` (argv, e.g. [python, -m, divergence, run, ...]) as n ranks; returns
    rank 0's exit code, or 1 with one line on stderr when a rank failed. kept(): words
    for what the failed run left (e.g. its partial traces), added to that line."""
    last = ""
    for _ in range(RETRIES):
        try:
            return _launch_once(command, n, label, env, kept)
        except LaunchFailed as e:
            last = str(e)
    print(f"{label}: error: could not connect {n} tensor-parallel ranks over 127.0.0.1: {last}", file=sys.stderr)
    return 1


def _rank_env(r: int, n: int, tmp: Path, kind: str, hostfile: Path | None, nccl_port: int | None) -> dict:
    env = rank_env(r, n, tmp, kind, hostfile, nccl_port)
    if CPU_SPLIT_ENV not in os.environ:  # the ranks share the cores (engine/kernels/splits.py)
        env[CPU_SPLIT_ENV] = str(max(1, usable_cores() // n))
    return env


def _launch_once(command, n, label, extra_env, kept) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="divergence-tp-"))
    kind = backend()
    hostfile = nccl_port = None
    if kind == "ring":
        hostfile = tmp / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(n)]))
    else:
        nccl_port = free_ports(1)[0]
    procs, logs = [], []
    for r in range(n):
        env = {**os.environ, **(extra_env or {}), **_rank_env(r, n, tmp, kind, hostfile, nccl_port)}
        out = None if r == 0 else open(tmp / f"rank{r}.log", "wb")
        err = subprocess.PIPE if r == 0 else subprocess.STDOUT
        procs.append(subprocess.Popen(command, env=env, stdout=out, stderr=err,
                                      preexec_fn=_die_with_parent if sys.platform == "linux" else None))
        if out is not None:
            logs.append(out)
    tail: list[str] = []
    fwd = threading.Thread(target=_forward_stderr, args=(procs[0].stderr, tail), daemon=True)
    fwd.start()
    try:
        code = _watch(procs, tmp, n, label, tail, kept)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        fwd.join(timeout=2)
        for f in logs:
            f.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return code


def _forward_stderr(pipe, tail: list) -> None:
    """Rank 0's stderr to ours, minus the ring backend's '[ring] ...' socket chatter."""
    for raw in iter(pipe.readline, b""):
        line = raw.decode("utf-8", "replace")
        if line.startswith(("[ring]", "[nccl]")):
            continue
        tail.append(line)
        del tail[:-20]
        if not _quiet(line):
            sys.stderr.write(line)
            sys.stderr.flush()
    pipe.close()


def _quiet(line: str) -> bool:
    return line.startswith("divergence-tp:")  # rank 0's failure report: the launcher words it


def _watch(procs, tmp: Path, n: int, label: str, tail: list, kept) -> int:
    started = time.monotonic()
    ready = False
    failed_at = None
    failure = ""
    rank0_done = None  # when rank 0 exited normally (the others then only have their exit left)
    while True:
        codes = [p.poll() for p in procs]
        if not ready:
            ready = all((tmp / f"ready.{r}").exists() for r in range(n))
            if not ready and time.monotonic() - started > READY_TIMEOUT:
                raise LaunchFailed(f"not all ranks connected within {READY_TIMEOUT:.0f} s")
        failing = [r for r, c in enumerate(codes) if c is not None and (c < 0 or c in (PEER_LOST, CRASHED))]
        if failing and failed_at is None:
            r = failing[0]
            if not ready and codes[r] >= 0 and _connect_error(tmp, r, tail):
                raise LaunchFailed(_last_line(tmp, r, tail, quiet_too=True))
            failed_at = time.monotonic()
        if all(c is not None for c in codes):
            break
        if codes[0] is not None and failed_at is None:
            rank0_done = rank0_done or time.monotonic()
            if time.monotonic() - rank0_done > 30:
                break
        if failed_at is not None and time.monotonic() - failed_at > GRACE:
            break
        time.sleep(POLL)
    if failed_at is None:
        return procs[0].returncode if procs[0].returncode is not None else 1
    killed = set()
    for r, p in enumerate(procs):  # stopped before the note reads what they wrote
        if p.poll() is None:
            killed.add(r)
            p.kill()
            p.wait()
    failure = _describe([p.returncode for p in procs], killed, tmp, tail)
    note = kept() if kept is not None else ""
    print(f"{label}: error: {failure}{'; ' + note if note else ''}", file=sys.stderr)
    return 1


def _describe(codes: list, killed: set, tmp: Path, tail: list) -> str:
    """The failure in words, from the rank that started it: one killed by a signal (not
    by us), else one that crashed, else one that lost its peers."""
    order = (lambda c: c < 0, lambda c: c == CRASHED, lambda c: c == PEER_LOST)
    for test in order:
        for rank, code in enumerate(codes):
            if rank not in killed and code is not None and test(code):
                return _describe_one(rank, code, tmp, tail)
    return "tensor-parallel ranks stopped without finishing; stopped all ranks"


def _describe_one(rank: int, code: int, tmp: Path, tail: list) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"tensor-parallel rank {rank} died (killed by {name}); stopped all ranks"
    if code == PEER_LOST:
        return f"tensor-parallel rank {rank} lost its connection to another rank; stopped all ranks"
    return f"tensor-parallel rank {rank} failed: {_last_line(tmp, rank, tail)}"


def _last_line(tmp: Path, rank: int, tail: list, *, quiet_too: bool = False) -> str:
    if rank == 0:
        lines = [ln.strip() for ln in tail if ln.strip() and (quiet_too or not _quiet(ln))]
    else:
        try:
            lines = [ln.strip() for ln in (tmp / f"rank{rank}.log").read_text(errors="replace").splitlines()
                     if ln.strip() and not ln.startswith("[ring]")]
        except OSError:
            lines = []
    return lines[-1] if lines else "no output"


def _connect_error(tmp: Path, rank: int, tail: list) -> bool:
    line = _last_line(tmp, rank, tail, quiet_too=True).lower()
    return any(w in line for w in ("address already in use", "connect", "bind"))
