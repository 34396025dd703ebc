"""Tensor parallelism over an `mx.distributed` group, sharded the way mlx-lm's
`Model.shard` shards a model (q/k/v/gate/up all-to-sharded, o/down sharded-to-all,
heads divided), but run through the engine's own dispatch: each rank's shard of an
op gets a kernel choice (with the shard's shape), and the all-reduce that adds the
sharded-to-all ops' partial sums is an explicit, recorded event.

Every rank runs the whole engine (scheduler, sampler) on identical data: the
all-reduce leaves the same bits on every rank, so every rank takes the same
decisions and the collectives stay matched without any extra messages.
The group is process-wide (mx.distributed.init is): `current()` is it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ..engine.kernels import blas as _blas  # noqa: F401  (loads the optimized BLAS: must precede mlx)
import mlx.core as mx

from ..core.events import AllReduce, Observer
from ..core.names import ALL_TO_SHARDED
from ..errors import RanksNeededError, TensorParallelError
from . import env as E
from .sharding import ShardedOp, shard_forward


@dataclass
class TensorParallel:
    """A process's place in a TP group. The engine holds it without importing this
    package: it calls `shard` on its forwards, hands it to each model's dispatcher,
    which calls `reduce_partial` / `run_unsharded`, and `gather_heads` for KV hashes."""

    group: object  # mx.distributed.Group
    backend: str
    world: list  # hosts of each rank (ports dropped: they change every launch)
    launcher: str  # "divergence" (its own ranks on one machine) or "mlx.launch"
    keep_full: bool = False  # engines keep the unsharded ops too (replay: STEP:unsharded)

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    @property
    def writes(self) -> bool:
        """Only rank 0 writes traces and prints."""
        return self.rank == 0

    def describe(self) -> dict:
        return {"degree": self.size, "backend": self.backend, "world": self.world, "launcher": self.launcher,
                "writer_rank": 0}

    # -- what the engine calls ----------------------------------------------------------
    def shard(self, forward) -> None:
        """Shard a PackedForward in place for this rank (sharding.shard_forward)."""
        shard_forward(forward, self, keep_full=self.keep_full)

    def reduce_partial(self, dispatch, out: mx.array, op: ShardedOp, layer: int) -> tuple[mx.array, AllReduce]:
        """A sharded-to-all op's partial product summed over the ranks, then its bias (as
        ShardedToAllLinear does), and the AllReduce event the dispatcher records."""
        event = AllReduce(dispatch.step, dispatch.model, layer, op.name, self.size, int(out.nbytes), self.backend)
        out = mx.distributed.all_sum(out, group=self.group)
        return (out if op.bias is None else out + op.bias), event

    def run_unsharded(self, dispatch, x: mx.array, op: ShardedOp, layer: int) -> mx.array:
        """STEP:unsharded: the full op on every rank, through the same kernel choice."""
        if op.full is None:
            raise TensorParallelError("STEP:unsharded needs the full weights (engines keep them for replay)")
        if op.shard == ALL_TO_SHARDED:
            n = op.n
            return dispatch.run_kernel(x, op.full, layer)[:, op.rank * n:(op.rank + 1) * n]
        return dispatch.run_kernel(self.gather_features(x), op.full, layer)

    def gather_features(self, x: mx.array) -> mx.array:
        """[M, k/N] on each rank -> [M, k], ranks' columns in rank order."""
        m, k = x.shape
        g = mx.distributed.all_gather(x, group=self.group)  # [N*M, k/N]
        return g.reshape(self.size, m, k).transpose(1, 0, 2).reshape(m, self.size * k)

    def gather_heads(self, a: mx.array) -> mx.array:
        """[layers, T, kv_heads/N, d] -> [layers, T, kv_heads, d]: KV rows as one device
        holds them, so KV-write hashes compare across TP degrees."""
        lay, t, h, d = a.shape
        g = mx.distributed.all_gather(a.reshape(lay * t, h * d), group=self.group)  # [N*lay*t, h*d]
        g = g.reshape(self.size, lay, t, h, d).transpose(1, 2, 0, 3, 4)
        return g.reshape(lay, t, self.size * h, d)


class Mirror(Observer):
    """What a rank other than 0 observes: nothing is kept, but it asks for the same
    work that takes part in collectives (gathering K/V rows for hashing), so every
    rank's collectives match rank 0's."""

    def __init__(self, kv_hashes: bool):
        self.wants_kv_hashes = kv_hashes


# -- the process-wide group ------------------------------------------------------------
_CURRENT: TensorParallel | None = None


def current() -> TensorParallel | None:
    return _CURRENT


def init_from_env(expected: int | None = None) -> TensorParallel:
    """Join the group this process was launched into (ring: MLX_HOSTFILE; NCCL:
    NCCL_HOST_IP / NCCL_PORT / MLX_WORLD_SIZE, as mlx.launch sets them)."""
    global _CURRENT
    if _CURRENT is not None:
        return _CURRENT
    backend = "nccl" if E.NCCL_ENV in os.environ else "ring"
    group = mx.distributed.init(strict=True, backend=backend)
    if expected is not None and expected > 1 and group.size() != expected:
        raise TensorParallelError(f"--tp {expected} but the launched group has {group.size()} ranks")
    launcher = "divergence" if E.SIZE_ENV in os.environ else "mlx.launch"
    _CURRENT = TensorParallel(group, backend, E.world(group.size()), launcher)
    d = os.environ.get(E.DIR_ENV)
    if d:  # tell the launcher this rank is connected (it retries on other ports otherwise)
        open(os.path.join(d, f"ready.{group.rank()}"), "w").close()
    return _CURRENT


def group_for(trace):
    """The group a replay of `trace` runs in: None for a one-device trace; this process's
    group when its size is the trace's degree (the CLI starts the ranks for that)."""
    n = trace.tp_degree
    if n <= 1:
        return None
    t = current()
    if t is None or t.size != n:
        where = "this process is in no group" if t is None else f"this process's group has {t.size} ranks"
        raise RanksNeededError(f"{trace.path} was recorded at TP={n} and {where}: replay it through the divergence CLI "
                          f"(replay / bisect --confirm start {n} ranks) or under mlx.launch -n {n}")
    return t
