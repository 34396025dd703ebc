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

import json
import os
from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn

from ..core.events import AllReduce, Observer
from ..core.names import ALL_TO_SHARDED
from ..errors import TensorParallelError
from .kernels import LinearOp

RANK_ENV = "MLX_RANK"
HOSTFILE_ENV = "MLX_HOSTFILE"
NCCL_ENV = "NCCL_HOST_IP"
# set by divergence's own launcher (tp_launch.py): the world size it started, and its
# directory for ready markers and rank 0's failure report
SIZE_ENV = "DIVERGENCE_TP_SIZE"
DIR_ENV = "DIVERGENCE_TP_DIR"


@dataclass
class TensorParallel:
    """A process's place in a TP group, and the hook for all-reduce events."""

    group: object  # mx.distributed.Group
    backend: str
    world: list  # hosts of each rank (ports dropped: they change every launch)
    launcher: str  # "divergence" (its own ranks on one machine) or "mlx.launch"
    emit: object = None  # callable(AllReduce) | None, set by the engine for a run
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

    # -- collectives ------------------------------------------------------------------
    def all_reduce(self, out: mx.array, *, step: int, model: str, layer: int, op: str) -> mx.array:
        if self.emit is not None:
            self.emit(AllReduce(step, model, layer, op, self.size, int(out.nbytes), self.backend))
        return mx.distributed.all_sum(out, group=self.group)

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
    backend = "nccl" if NCCL_ENV in os.environ else "ring"
    group = mx.distributed.init(strict=True, backend=backend)
    if expected is not None and expected > 1 and group.size() != expected:
        raise TensorParallelError(f"--tp {expected} but the launched group has {group.size()} ranks")
    world = _world(backend, group.size())
    launcher = "divergence" if SIZE_ENV in os.environ else "mlx.launch"
    _CURRENT = TensorParallel(group, backend, world, launcher)
    d = os.environ.get(DIR_ENV)
    if d:  # tell the launcher this rank is connected (it retries on other ports otherwise)
        open(os.path.join(d, f"ready.{group.rank()}"), "w").close()
    return _CURRENT


def group_for(trace):
    """The group a replay of `trace` runs in: None for a one-device trace; this process's
    group when its size is the trace's degree (the CLI starts the ranks for that)."""
    from ..errors import ReplayError

    n = trace.tp_degree
    if n <= 1:
        return None
    t = current()
    if t is None or t.size != n:
        where = "this process is in no group" if t is None else f"this process's group has {t.size} ranks"
        raise ReplayError(f"{trace.path} was recorded at TP={n} and {where}: replay it through the divergence CLI "
                          f"(replay / bisect --confirm start {n} ranks) or under mlx.launch -n {n}")
    return t


def _world(backend: str, size: int) -> list:
    if backend == "ring":
        try:
            with open(os.environ[HOSTFILE_ENV]) as f:
                hosts = json.load(f)
            return [[a.rsplit(":", 1)[0] for a in node] for node in hosts]
        except (OSError, ValueError, KeyError):
            pass
    return [[os.environ.get(NCCL_ENV, "?")] for _ in range(size)]


# -- sharding ------------------------------------------------------------------------------
@dataclass
class ShardedOp(LinearOp):
    """This rank's shard of a linear op, with the bias a sharded-to-all op adds after
    the all-reduce (as ShardedToAllLinear does) and, for replay's STEP:unsharded, the
    full op (replicated: no shard mode)."""

    rank: int = 0
    size: int = 1
    bias: mx.array | None = None
    full: LinearOp | None = None


def check_divisible(forward, size: int) -> None:
    """The one-line reason a model cannot be split `size` ways, as a typed error."""
    if size < 1:
        raise TensorParallelError(f"--tp must be >= 1, got {size}")
    f = forward
    if any(ops.gate is None for ops in f.ops):
        raise TensorParallelError(f"--tp {size}: mixture-of-experts layers are not sharded (dense models only)")
    for what, n in (("attention heads", f.n_heads), ("KV heads", f.n_kv_heads)):
        if n % size:
            raise TensorParallelError(f"--tp {size} does not divide the model's {n} {what}")
    ops = f.ops[0]
    for op in (ops.gate, ops.o, ops.down):
        dim = op.n if op.shard == ALL_TO_SHARDED else op.k
        if dim % size:
            raise TensorParallelError(f"--tp {size} does not divide {op.name}'s {dim} features")
    for op in (ops.o, ops.down):
        g = getattr(op.module, "group_size", 0) if op.quantized else 0
        if g and (op.k // size) % g:
            raise TensorParallelError(f"--tp {size}: {op.name}'s {op.k} inputs split {size} ways are not a "
                                      f"multiple of the quantization group ({g})")


def shard_forward(forward, tp: TensorParallel, *, keep_full: bool = False) -> None:
    """Shard a PackedForward in place for this rank (mlx's shard_linear slices the
    weights, so the shards are bit for bit mlx-lm's). keep_full keeps the unsharded
    ops too, for replay's STEP:unsharded (memory: one more copy of those weights)."""
    check_divisible(forward, tp.size)
    for ops in forward.ops:
        for attr in ("q", "k", "v", "o", "gate", "up", "down"):
            op = getattr(ops, attr)
            if op.shard is not None:
                setattr(ops, attr, shard_op(op, tp, keep_full=keep_full))
    forward.n_heads //= tp.size
    forward.n_kv_heads //= tp.size
    forward.tp = tp


def shard_op(op: LinearOp, tp: TensorParallel, *, keep_full: bool = False) -> ShardedOp:
    from mlx.nn.layers.distributed import shard_linear

    sharded = shard_linear(op.module, op.shard, group=tp.group)
    full = replace(op, shard=None) if keep_full else None
    common = dict(name=op.name, tied_embedding=False, shard=op.shard, rank=tp.rank, size=tp.size, full=full)
    if op.shard == ALL_TO_SHARDED:
        # its __call__ is the local product (+ its slice of the bias): the native kernel
        return ShardedOp(module=sharded, n=op.n // tp.size, k=op.k, **common)
    bias = sharded["bias"] if "bias" in sharded else None
    return ShardedOp(module=_local_partial(sharded), n=op.n, k=op.k // tp.size, bias=bias, **common)


def _local_partial(sharded) -> nn.Module:
    """A sharded-to-all layer without its all_sum and bias: the rank's partial product
    (the dispatcher adds the all-reduce and the bias after it, as ShardedToAllLinear does)."""
    if hasattr(sharded, "scales"):
        m = nn.QuantizedLinear.__new__(nn.QuantizedLinear)
        nn.Module.__init__(m)
        m.group_size, m.bits, m.mode = sharded.group_size, sharded.bits, sharded.mode
        m.weight, m.scales = sharded["weight"], sharded["scales"]
        if sharded.get("biases") is not None:
            m.biases = sharded["biases"]
        m.freeze()
        return m
    m = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(m)
    m.weight = sharded["weight"]
    return m


def attach(dispatch, tp: TensorParallel) -> None:
    """Give a model's dispatcher its all-reduce (recorded, then the bias) and the
    STEP:unsharded path (the full op on every rank, through the same kernel choice)."""

    def all_reduce(out: mx.array, op: ShardedOp, layer: int) -> mx.array:
        out = tp.all_reduce(out, step=dispatch._step, model=dispatch.model, layer=layer, op=op.name)
        return out if op.bias is None else out + op.bias

    def unsharded(x: mx.array, op: ShardedOp, layer: int) -> mx.array:
        if op.full is None:
            raise TensorParallelError("STEP:unsharded needs the full weights (engines keep them for replay)")
        if op.shard == ALL_TO_SHARDED:
            n = op.n
            return dispatch.run_kernel(x, op.full, layer)[:, op.rank * n:(op.rank + 1) * n]
        return dispatch.run_kernel(tp.gather_features(x), op.full, layer)

    dispatch.all_reduce = all_reduce
    dispatch.unsharded = unsharded
