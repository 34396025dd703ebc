"""One model's share of a run: its forward, paged KV cache and kernel dispatcher,
how one step plan is executed on them (whole, or request by request when replay
forces SOLO), and the KV writes a step made, as hashed events."""
from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np

from ..core.hashing import hash_rows
from ..core.policy import KernelPolicy
from .bits import raw_rows
from .dispatch import KernelDispatcher
from ..core.events import KvWrite, StepPlan
from .forward import PackedForward, StepOutput
from .kv_cache import BlockManager
from .model import LoadedModel
from .moe import merge_routing


class ModelState:
    """One model's forward, cache and dispatcher for one run."""

    def __init__(self, loaded: LoadedModel, forward: PackedForward, policy: KernelPolicy, name: str,
                 num_blocks: int, block_size: int, prefix_caching: bool, emit):
        self.loaded = loaded
        self.forward = forward
        self.name = name
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching=prefix_caching)
        self.cache = forward.make_cache(num_blocks, block_size)
        self.dispatch = KernelDispatcher(policy, name, emit, forward.native_classes, forward.attention_classes)
        self.tap = None  # optional per-op output tap for every forward of this state (see forward.py)
        if getattr(forward, "tp", None) is not None:  # tensor parallel: all-reduce, unsharded replay
            from .tp import attach

            attach(self.dispatch, forward.tp)

    def forward_step(self, plan: StepPlan, *, keep_kv: bool, keep_routing: bool = False) -> StepOutput:
        out = self._forward_step(plan, keep_kv=keep_kv, keep_routing=keep_routing)
        tp = getattr(self.forward, "tp", None)
        if keep_kv and tp is not None:  # hash K/V as one device holds them: all heads
            out = replace(out, k_written=tp.gather_heads(out.k_written), v_written=tp.gather_heads(out.v_written))
        return out

    def _forward_step(self, plan: StepPlan, *, keep_kv: bool, keep_routing: bool = False) -> StepOutput:
        """The step's forward pass (lazy). A step forced SOLO runs each slice in its own
        pass, evaluated before the next, exactly as a step holding only that slice;
        outputs are joined in slice order."""
        if not (self.dispatch.solo(plan.index) and len(plan.slices) > 1):
            return self.forward(plan, self.cache, self.blocks, self.dispatch, keep_kv=keep_kv,
                                keep_routing=keep_routing, tap=self.tap)
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


def kv_writes(plan: StepPlan, model: str, k: mx.array, v: mx.array) -> list[KvWrite]:
    """The step's KV writes, one per (slice, layer), with per-position hashes of the
    exact stored bytes; k, v: [layers, T, kv_heads, head_dim] in slice order. Hashed
    for the whole step at once (per slice was measurably slower)."""
    kh, vh = kv_hashes(k, v)
    layers = k.shape[0]
    out = []
    for s in plan.slices:
        r0, r1 = s.row_offset, s.row_offset + s.count
        for layer in range(layers):
            out.append(KvWrite(plan.index, model, s.request_id, layer, s.start, s.count, kh[layer, r0:r1],
                               vh[layer, r0:r1]))
    return out


def kv_hashes(k: mx.array, v: mx.array) -> tuple[np.ndarray, np.ndarray]:
    """uint64 [layers, T] hashes of every position's exact K and V bytes (all kv heads),
    for a whole step in one call; k, v: [layers, T, kv_heads, head_dim]."""
    layers, rows = k.shape[0], k.shape[1]
    kh = hash_rows(raw_rows(k.reshape(layers * rows, -1))).reshape(layers, rows)
    vh = hash_rows(raw_rows(v.reshape(layers * rows, -1))).reshape(layers, rows)
    return kh, vh
