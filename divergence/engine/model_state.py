"""One model's share of a run: its forward, paged KV cache and kernel dispatcher,
how one step plan is executed on them (whole, or request by request when replay
forces SOLO). The KV writes a step made, as hashed events: kv_events.py."""
from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
from ..core.policy import KernelPolicy
from .kernels.dispatch import KernelDispatcher
from ..core.events import StepPlan
from .model.forward import PackedForward, StepOutput
from .sched.blocks import BlockManager
from .model.loading import LoadedModel
from .model.moe import merge_routing


class ModelState:
    """One model's forward, cache and dispatcher for one run."""

    def __init__(self, loaded: LoadedModel, forward: PackedForward, policy: KernelPolicy, name: str,
                 num_blocks: int, block_size: int, prefix_caching: bool, emit):
        self.loaded = loaded
        self.forward = forward
        self.name = name
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching=prefix_caching)
        self.cache = forward.make_cache(num_blocks, block_size)
        # tensor parallel: the forward was sharded for this rank and holds its group
        self.dispatch = KernelDispatcher(policy, name, emit, forward.native_classes, forward.attention_classes,
                                         parallel=getattr(forward, "tp", None))
        self.tap = None  # optional per-op output tap for every forward of this state (see forward.py)

    def forward_step(self, plan: StepPlan, *, keep_kv: bool, keep_routing: bool = False,
                     tokens: mx.array | None = None) -> StepOutput:
        """tokens: input ids still on the device (see PackedForward.__call__)."""
        out = self._forward_step(plan, keep_kv=keep_kv, keep_routing=keep_routing, tokens=tokens)
        tp = getattr(self.forward, "tp", None)
        if keep_kv and tp is not None:  # hash K/V as one device holds them: all heads
            out = replace(out, k_written=tp.gather_heads(out.k_written), v_written=tp.gather_heads(out.v_written))
        return out

    def _forward_step(self, plan: StepPlan, *, keep_kv: bool, keep_routing: bool = False,
                      tokens: mx.array | None = None) -> StepOutput:
        """The step's forward pass (lazy). A step forced SOLO runs each slice in its own
        pass, evaluated before the next, exactly as a step holding only that slice;
        outputs are joined in slice order."""
        if not (self.dispatch.solo(plan.index) and len(plan.slices) > 1):
            return self.forward(plan, self.cache, self.blocks, self.dispatch, keep_kv=keep_kv,
                                keep_routing=keep_routing, tap=self.tap, tokens=tokens)
        parts = []
        for s in plan.slices:
            alone = StepPlan(plan.index, plan.model, (replace(s, row_offset=0),))
            out = self.forward(alone, self.cache, self.blocks, self.dispatch, keep_kv=keep_kv,
                               keep_routing=keep_routing, tap=self.tap)
            mx.eval(out.logits, *((out.k_written, out.v_written) if keep_kv else ()), *self.cache.arrays(),
                    *(a for r in out.routing or () for a in r.arrays()))
            parts.append(out)
        logits = mx.concatenate([p.logits for p in parts], axis=0)
        routing = merge_routing([p.routing for p in parts]) if keep_routing else None
        if not keep_kv:
            return StepOutput(logits, routing=routing)
        return StepOutput(logits, mx.concatenate([p.k_written for p in parts], axis=1),
                          mx.concatenate([p.v_written for p in parts], axis=1), routing)

