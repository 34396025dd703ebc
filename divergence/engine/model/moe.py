"""Mixture-of-experts layers (qwen3_moe, mixtral) in the packed forward.

The block is mlx-lm's own sparse MoE module, run in its order of operations:
router `gate` (a dispatched linear op) -> softmax / top-k exactly as the family
does it -> the selected experts' SwiGLU (`experts`, dispatched per policy, see
expert_kernels) -> the score-weighted sum. Under `native` both ops are the
module's own calls, so the numbers are mlx-lm's. What the router chose for every
row is kept (when asked) as exact arrays, turned into Routing events after the
step is evaluated.
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ...core.events import Routing, StepPlan
from ...core.names import GATE
from ..kernels.experts import ExpertWeights, run_experts
from ..kernels.linear import LinearOp

# qwen3_moe: softmax over all experts, then top-k (optionally renormalised);
# mixtral: top-k of the raw router logits, then softmax over the k.
SOFTMAX_THEN_TOPK = "softmax-topk"
TOPK_THEN_SOFTMAX = "topk-softmax"
FAMILY_ROUTING = {"qwen3_moe": SOFTMAX_THEN_TOPK, "mixtral": TOPK_THEN_SOFTMAX}


@dataclass
class LayerRouting:
    """One MoE layer's routing for every row of a step (lazy mx arrays until evaluated)."""

    layer: int
    experts: mx.array  # int [T, k], in the order the block used them
    ranked: mx.array  # [T, E] the values top-k ranked (router probabilities or logits)
    gate_input: mx.array  # [T, hidden] what the router saw (hashed: contaminated input or not)

    def arrays(self) -> tuple:
        return self.experts, self.ranked, self.gate_input


def moe_module(layer):
    """The layer's sparse MoE module, or None for a dense MLP layer."""
    for name in ("mlp", "block_sparse_moe"):
        m = getattr(layer, name, None)
        if m is not None and hasattr(m, "switch_mlp") and hasattr(m, "gate"):
            return m
    return None


def moe_block(layer, model_type: str):
    """A MoeBlock for the layer, or None when the layer is dense."""
    m = moe_module(layer)
    if m is None:
        return None
    if model_type not in FAMILY_ROUTING:
        raise ValueError(f"no MoE routing known for model_type {model_type!r}")
    return MoeBlock(m, FAMILY_ROUTING[model_type])


class MoeBlock:
    """mlx-lm's Qwen3MoeSparseMoeBlock / MixtralSparseMoeBlock with dispatched ops."""

    kind = "moe"

    def __init__(self, module, routing: str):
        self.module = module
        self.routing = routing
        self.gate = LinearOp.from_module(GATE, module.gate)
        self.top_k = int(getattr(module, "top_k", None) or module.num_experts_per_tok)
        self.norm_topk_prob = bool(getattr(module, "norm_topk_prob", False))
        self.experts = ExpertWeights(module.switch_mlp)
        self.num_experts = self.experts.num_experts

    def route(self, logits: mx.array):
        """(indices [T, k], mixing scores [T, k], ranked values [T, E]) exactly as mlx-lm computes them."""
        k = self.top_k
        if self.routing == SOFTMAX_THEN_TOPK:
            gates = mx.softmax(logits, axis=-1, precise=True)
            inds = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]
            scores = mx.take_along_axis(gates, inds, axis=-1)
            if self.norm_topk_prob:
                scores = scores / mx.sum(scores, axis=-1, keepdims=True)
            return inds, scores, gates
        inds = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]
        scores = mx.take_along_axis(logits, inds, axis=-1)
        scores = mx.softmax(scores, axis=-1, precise=True)
        return inds, scores, logits

    def __call__(self, x: mx.array, dispatch, layer: int, sink: list | None = None, *, tap=None) -> mx.array:
        logits = dispatch(x, self.gate, layer)
        if tap is not None:
            tap(layer, GATE, logits)
        inds, scores, ranked = self.route(logits)
        y = run_experts(x, inds, self.experts, dispatch, layer)
        if sink is not None:
            sink.append(LayerRouting(layer, inds, ranked, x))
        out = (y * scores[..., None]).sum(axis=-2)
        # qwen3_moe casts back to the expert output dtype; mixtral does not (a no-op when dtypes agree)
        return out.astype(y.dtype) if self.routing == SOFTMAX_THEN_TOPK else out


def merge_routing(parts: list[list[LayerRouting]]) -> list[LayerRouting]:
    """Routing of a step run request by request (SOLO): rows joined in slice order per layer."""
    if len(parts) == 1:
        return parts[0]
    out = []
    for recs in zip(*parts):
        out.append(LayerRouting(recs[0].layer, *(mx.concatenate(a, axis=0) for a in zip(*(r.arrays() for r in recs)))))
    return out


def routing_events(plan: StepPlan, model: str, routing: list[LayerRouting]) -> list[Routing]:
    """One Routing event per (slice, MoE layer), values exact (float32 holds bf16/fp16 exactly)."""
    from ...core.hashing import hash_rows
    from ..kernels.bits import raw_rows

    out = []
    for rec in routing:
        experts = np.array(rec.experts).astype(np.int32)
        ranked = np.array(rec.ranked.astype(mx.float32))
        t, k = experts.shape
        scores = np.take_along_axis(ranked, experts, axis=1)
        masked = ranked.copy()
        np.put_along_axis(masked, experts, -np.inf, axis=1)
        runner = np.argmax(masked, axis=1).astype(np.int32) if ranked.shape[1] > k else np.full(t, -1, np.int32)
        runner_score = (masked[np.arange(t), runner] if ranked.shape[1] > k
                        else np.full(t, np.nan, np.float32)).astype(np.float32)
        hashes = hash_rows(raw_rows(rec.gate_input))
        for s in plan.slices:
            r0, r1 = s.row_offset, s.row_offset + s.count
            out.append(Routing(plan.index, model, s.request_id, rec.layer, s.start, s.count, experts[r0:r1],
                               scores[r0:r1].astype(np.float32), runner[r0:r1], runner_score[r0:r1],
                               hashes[r0:r1]))
    return out
