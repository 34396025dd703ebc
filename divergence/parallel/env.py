"""The environment a tensor-parallel rank is started with: every name in one place,
and what they say (stdlib only: the launcher and the CLI read them without MLX)."""
from __future__ import annotations

import json
import os

# as mlx.launch sets them
RANK_ENV = "MLX_RANK"
HOSTFILE_ENV = "MLX_HOSTFILE"  # ring backend: the ranks' addresses
NCCL_ENV = "NCCL_HOST_IP"  # NCCL backend: rank 0's address, port and the world size
NCCL_PORT_ENV = "NCCL_PORT"
WORLD_SIZE_ENV = "MLX_WORLD_SIZE"
GPUS_ENV = "CUDA_VISIBLE_DEVICES"
# set by divergence's own launcher (launch.py): the world size it started, its directory
# for ready markers and rank 0's failure report, and the backend it was asked for
SIZE_ENV = "DIVERGENCE_TP_SIZE"
DIR_ENV = "DIVERGENCE_TP_DIR"
BACKEND_ENV = "DIVERGENCE_TP_BACKEND"  # ring (default) | nccl


def in_launched_group() -> bool:
    """Started as one rank of a group, by divergence's launcher or by mlx.launch?"""
    env = os.environ
    return RANK_ENV in env and any(k in env for k in (HOSTFILE_ENV, NCCL_ENV, SIZE_ENV))


def is_writer() -> bool:
    """Does this process write traces and print reports (rank 0, or no group)?"""
    if not in_launched_group():
        return True
    try:
        return int(os.environ[RANK_ENV]) == 0
    except ValueError:
        return True


def launched_size() -> int | None:
    """The size of the group this process was launched into, from its environment."""
    for k in (SIZE_ENV, WORLD_SIZE_ENV):
        if k in os.environ:
            return int(os.environ[k])
    try:
        with open(os.environ[HOSTFILE_ENV]) as f:
            return len(json.load(f))
    except (KeyError, OSError, ValueError):
        return None


def backend() -> str:
    """ring (default: any machine) or nccl (one process per GPU of this host), from
    DIVERGENCE_TP_BACKEND; mlx.launch picks for itself when it starts the ranks."""
    b = os.environ.get(BACKEND_ENV, "ring").strip().lower()
    if b not in ("ring", "nccl"):
        raise ValueError(f"{BACKEND_ENV}={b!r}: expected ring or nccl")
    return b


def world(size: int) -> list:
    """The hosts of each rank (ports dropped: they change every launch)."""
    if NCCL_ENV not in os.environ:
        try:
            with open(os.environ[HOSTFILE_ENV]) as f:
                hosts = json.load(f)
            return [[a.rsplit(":", 1)[0] for a in node] for node in hosts]
        except (OSError, ValueError, KeyError):
            pass
    return [[os.environ.get(NCCL_ENV, "?")] for _ in range(size)]


def rank_env(rank: int, size: int, tmp, kind: str, hostfile, nccl_port: int | None) -> dict:
    """The variables one rank started by launch.py gets (on top of the parent's)."""
    env = {RANK_ENV: str(rank), SIZE_ENV: str(size), DIR_ENV: str(tmp)}
    if kind == "ring":
        env[HOSTFILE_ENV] = str(hostfile)
        return env
    # as mlx.launch --backend nccl sets them: rank 0's address and port, the world size,
    # and one GPU per rank (the r-th of the visible ones)
    visible = [d for d in os.environ.get(GPUS_ENV, "").split(",") if d.strip()]
    env.update({NCCL_ENV: "127.0.0.1", NCCL_PORT_ENV: str(nccl_port), WORLD_SIZE_ENV: str(size),
                GPUS_ENV: visible[rank] if rank < len(visible) else str(rank)})
    return env
