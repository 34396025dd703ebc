"""The packed forward: every token of a step in one [T, hidden] matrix.

Linear layers see the real row count of the step (120 prefill rows of one
request + 4 verify rows of another = 124 rows) and go through the kernel
dispatcher; attention runs per sequence against its own paged KV cache. The
modules, weights and elementwise functions are mlx-lm's own, called in the same
order as its forward, so under `native` kernels the numbers are mlx-lm's.
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.activations import swiglu

from .dispatch import KernelDispatcher
from ..core.events import StepPlan
from .kernels import LinearOp
from .kv_cache import BlockManager, PagedKVCache
from .model import LoadedModel
from .moe import LayerRouting, moe_block
from .native_classes import NativeClassProbe


@dataclass
class LayerOps:
    q: LinearOp
    k: LinearOp
    v: LinearOp
    o: LinearOp
    gate: LinearOp | None  # None in a mixture-of-experts layer (see moe.py)
    up: LinearOp | None
    down: LinearOp | None


@dataclass
class StepOutput:
    logits: mx.array  # [R, vocab] in the model dtype, R = total logit rows, slice order
    # When asked: every K / V row the step wrote, [layers, T, kv_heads, head_dim] in
    # slice order, so the engine converts and hashes them in one go (not per slice).
    k_written: mx.array | None = None
    v_written: mx.array | None = None
    # When asked: what each MoE layer's router chose for every row (see moe.routing_events).
    routing: list[LayerRouting] | None = None


class PackedForward:
    def __init__(self, loaded: LoadedModel):
        lm = loaded.model
        self.loaded = loaded
        self.inner = lm.model
        self.blocks = list(lm.layers)
        self.ops = []
        self.moe = [moe_block(layer, loaded.config.get("model_type")) for layer in self.blocks]
        for layer, moe in zip(self.blocks, self.moe):
            a = layer.self_attn
            mlp = (LinearOp.from_module(n, getattr(layer.mlp, n)) for n in ("gate_proj", "up_proj", "down_proj"))
            self.ops.append(
                LayerOps(*(LinearOp.from_module(n, getattr(a, n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")),
                         *((None, None, None) if moe else mlp))
            )
        if getattr(lm.args, "tie_word_embeddings", False) or not hasattr(lm, "lm_head"):
            self.head = LinearOp.from_module("lm_head", self.inner.embed_tokens, tied_embedding=True)
        else:
            self.head = LinearOp.from_module("lm_head", lm.lm_head)
        attn0 = self.blocks[0].self_attn
        # mixtral's attention names them num_heads / num_key_value_heads
        self.n_heads = getattr(attn0, "n_heads", None) or attn0.num_heads
        self.n_kv_heads = getattr(attn0, "n_kv_heads", None) or attn0.num_key_value_heads
        self.head_dim = self.ops[0].q.n // self.n_heads
        self.scale = attn0.scale
        self.has_qk_norm = hasattr(attn0, "q_norm")
        self.dtype = self.inner.norm.weight.dtype
        self.native_classes = NativeClassProbe()  # memo of the native ops' class signatures

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    def make_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        return PagedKVCache(self.num_layers, num_blocks, block_size, self.n_kv_heads, self.head_dim, self.dtype)

    def __call__(
        self,
        plan: StepPlan,
        cache: PagedKVCache,
        blocks: BlockManager,
        dispatch: KernelDispatcher,
        *,
        keep_kv: bool = False,
        keep_routing: bool = False,
    ) -> StepOutput:
        dispatch.begin_step(plan.index)
        tokens = mx.array(np.concatenate([np.asarray(s.tokens, dtype=np.int32) for s in plan.slices]))
        # Slot indices per slice: where its new rows go, and all positions it reads.
        write_slots, read_slots = [], []
        for s in plan.slices:
            all_slots = blocks.slots(s.request_id, 0, s.start + s.count)
            write_slots.append(mx.array(all_slots[s.start :]))
            read_slots.append(mx.array(all_slots))
        k_layers, v_layers = [], []
        routing = [] if keep_routing else None
        h = self.inner.embed_tokens(tokens)
        for li, (layer, ops) in enumerate(zip(self.blocks, self.ops)):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q_all, k_all, v_all = dispatch(x, ops.q, li), dispatch(x, ops.k, li), dispatch(x, ops.v, li)
            outs, ks, vs = [], [], []
            for si, s in enumerate(plan.slices):
                r0, n = s.row_offset, s.count
                q = q_all[r0 : r0 + n].reshape(1, n, self.n_heads, -1)
                k = k_all[r0 : r0 + n].reshape(1, n, self.n_kv_heads, -1)
                v = v_all[r0 : r0 + n].reshape(1, n, self.n_kv_heads, -1)
                if self.has_qk_norm:
                    q, k = attn.q_norm(q), attn.k_norm(k)
                q = attn.rope(q.transpose(0, 2, 1, 3), offset=s.start)
                k = attn.rope(k.transpose(0, 2, 1, 3), offset=s.start)
                k_rows = k[0].transpose(1, 0, 2)  # [n, kv_heads, head_dim] as cached
                v_rows = v[0]
                cache.write(li, write_slots[si], k_rows, v_rows)
                if keep_kv:
                    ks.append(k_rows)
                    vs.append(v_rows)
                keys, values = cache.read(li, read_slots[si])
                keys = keys.transpose(1, 0, 2)[None]
                values = values.transpose(1, 0, 2)[None]
                o = mx.fast.scaled_dot_product_attention(
                    q, keys, values, scale=self.scale, mask="causal" if n > 1 else None
                )
                outs.append(o.transpose(0, 2, 1, 3).reshape(n, -1))
            if keep_kv:
                k_layers.append(ks[0] if len(ks) == 1 else mx.concatenate(ks, axis=0))
                v_layers.append(vs[0] if len(vs) == 1 else mx.concatenate(vs, axis=0))
            a = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
            h = h + dispatch(a, ops.o, li)
            x = layer.post_attention_layernorm(h)
            if self.moe[li] is not None:
                h = h + self.moe[li](x, dispatch, li, routing)
                continue
            g, u = dispatch(x, ops.gate, li), dispatch(x, ops.up, li)
            h = h + dispatch(swiglu(g, u), ops.down, li)
        rows = [s.row_offset + r for s in plan.slices for r in s.logit_rows]
        if rows:
            hl = h[mx.array(np.asarray(rows, dtype=np.int32))]
            logits = dispatch(self.inner.norm(hl), self.head, self.num_layers)
        else:
            logits = mx.zeros((0, self.head.n), dtype=self.dtype)
        if keep_kv:
            return StepOutput(logits, mx.stack(k_layers), mx.stack(v_layers), routing)
        return StepOutput(logits, routing=routing)
