"""Sharding a model the way mlx-lm's `Model.shard` does (q/k/v/gate/up all-to-sharded,
o/down sharded-to-all, heads divided), with mlx's own shard_linear, so every rank's
shards are bit for bit mlx-lm's; the dispatcher runs them (group.py: the all-reduce)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..engine.kernels import blas as _blas  # noqa: F401  (loads the optimized BLAS: must precede mlx)
import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_linear

from ..core.names import ALL_TO_SHARDED
from ..engine.kernels.linear import LinearOp
from .divisible import ShardShape, check_degree


@dataclass
class ShardedOp(LinearOp):
    """This rank's shard of a linear op, with the bias a sharded-to-all op adds after
    the all-reduce (as ShardedToAllLinear does) and, for replay's STEP:unsharded, the
    full op (replicated: no shard mode)."""

    rank: int = 0
    size: int = 1
    bias: mx.array | None = None
    full: LinearOp | None = None


def forward_shape(forward) -> ShardShape:
    """The numbers the divisibility rule reads, from a loaded PackedForward."""
    ops = forward.ops[0]
    quant = getattr(ops.o.module, "group_size", 0) if ops.o.quantized else 0
    return ShardShape(forward.n_heads, forward.n_kv_heads, ops.o.k // forward.n_heads, ops.down.k,
                      experts=any(o.gate is None for o in forward.ops), quant_group=quant)


def shard_forward(forward, tp, *, keep_full: bool = False) -> None:
    """Shard a PackedForward in place for this rank (mlx's shard_linear slices the
    weights, so the shards are bit for bit mlx-lm's). keep_full keeps the unsharded
    ops too, for replay's STEP:unsharded (memory: one more copy of those weights)."""
    check_degree(forward_shape(forward), tp.size)
    for ops in forward.ops:
        for attr in ("q", "k", "v", "o", "gate", "up", "down"):
            op = getattr(ops, attr)
            if op.shard is not None:
                setattr(ops, attr, shard_op(op, tp, keep_full=keep_full))
    forward.n_heads //= tp.size
    forward.n_kv_heads //= tp.size
    forward.tp = tp


def shard_op(op: LinearOp, tp, *, keep_full: bool = False) -> ShardedOp:
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
