"""The per-layer pieces the packed forward runs: the layer's linear ops and its MLP as
a replaceable block.

The MLP is an object with one call, `block(x, dispatch, layer, sink=None, *, tap=None)
-> [T, hidden]` (`sink` collects what a router chose; dense blocks ignore it), so a
layer whose feed-forward is not a dense SwiGLU (moe.MoeBlock) plugs in without
touching the forward. `mlp_block` picks the block for a layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu

from ...errors import UnsupportedModelError
from ..kernels.linear import LinearOp

Tap = Callable[[int, str, mx.array], None]


@dataclass
class LayerOps:
    """The dispatched linear ops of one layer (gate/up/down None in a mixture-of-experts
    layer). Tensor parallelism swaps them for shards in place (parallel/group.py)."""

    q: LinearOp
    k: LinearOp
    v: LinearOp
    o: LinearOp
    gate: LinearOp | None = None
    up: LinearOp | None = None
    down: LinearOp | None = None

    @classmethod
    def from_layer(cls, layer: nn.Module, *, dense: bool) -> "LayerOps":
        a = layer.self_attn
        attn = (LinearOp.from_module(n, getattr(a, n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        mlp = (LinearOp.from_module(n, getattr(layer.mlp, n)) for n in ("gate_proj", "up_proj", "down_proj"))
        return cls(*attn, *(mlp if dense else ()))

    def linear_ops(self) -> tuple[LinearOp, ...]:
        return tuple(op for op in (self.q, self.k, self.v, self.o, self.gate, self.up, self.down) if op is not None)


class DenseMLP:
    """mlx-lm's MLP: down(swiglu(gate(x), up(x))), each projection dispatched (read from
    the layer's LayerOps at call time, so sharded ops take effect)."""

    kind = "dense"

    def __init__(self, ops: LayerOps):
        self.ops = ops

    def __call__(self, x: mx.array, dispatch, layer: int, sink: list | None = None, *,
                 tap: Tap | None = None) -> mx.array:
        ops = self.ops
        g, u = dispatch(x, ops.gate, layer), dispatch(x, ops.up, layer)
        a = swiglu(g, u)
        y = dispatch(a, ops.down, layer)
        if tap is not None:
            for point, rows in (("gate_proj", g), ("up_proj", u), ("swiglu", a), ("down_proj", y)):
                tap(layer, point, rows)
        return y


def mlp_block(layer: nn.Module, ops: LayerOps, model_type: str | None):
    """The layer's MLP block: a MoeBlock for a sparse mixture-of-experts layer, else dense."""
    from .moe import moe_block

    moe = moe_block(layer, model_type)
    if moe is not None:
        return moe
    if ops.gate is None:
        raise UnsupportedModelError(f"no MLP block for {type(layer.mlp).__name__} (known: dense SwiGLU, MoE)")
    return DenseMLP(ops)
