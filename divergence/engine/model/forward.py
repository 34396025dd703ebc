"""The packed forward: every token of a step in one [T, hidden] matrix.

Linear layers see the real row count of the step (120 prefill rows of one
request + 4 verify rows of another = 124 rows) and go through the kernel
dispatcher; so does attention (`per-seq` or `batched`, see attention.py). The
host prepares the step once (prepared.py: positions, write slots, block tables,
masks, logit rows); each layer then runs a fixed handful of MLX ops whatever the
number of sequences. The modules, weights and elementwise functions are mlx-lm's
own, called in the same order as its forward, so under `native` kernels at one
sequence the numbers are mlx-lm's.

An optional `tap(layer, point, rows)` sees the output of every op (core.names
TAP_POINTS) as [T, ...] rows in step order; unset, it costs nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import rope_utils

from ...core.events import StepPlan
from ...core.policy import NATIVE
from ..kernels.backend_proofs import row_alone_is_exact
from .layers import LayerOps, Tap, mlp_block
from ..kernels.dispatch import KernelDispatcher
from ..kernels.linear import LinearOp
from ..sched.blocks import BlockManager
from .compiled_step import CompiledDecode, default_on as compiled_default_on
from .kv_cache import PagedKVCache
from .loading import LoadedModel
from .moe import LayerRouting, moe_module
from ..kernels.native_classes import AttentionClassProbe, NativeClassProbe
from .prepared import PreparedStep, batchable_count, prepare_step
from .rotary import StepRotation, fallback_in_use, shared_rope

# RoPE modules whose offset may be a vector (one position per row): one call for the
# whole step. Others (dynamic NTK scaling reads the offset as a number) go slice by slice.
_VECTOR_ROPE = tuple(c for c in (nn.RoPE, getattr(rope_utils, "Llama3RoPE", None),
                                 getattr(rope_utils, "YarnRoPE", None), getattr(rope_utils, "SuScaledRoPE", None))
                     if c is not None)


@dataclass(frozen=True)
class LayerParts:
    """The modules of one decoder layer the forward calls besides its linear ops."""

    input_norm: nn.Module
    post_norm: nn.Module
    rope: nn.Module
    q_norm: nn.Module | None
    k_norm: nn.Module | None

    @classmethod
    def of(cls, layer) -> "LayerParts":
        attn = layer.self_attn
        return cls(layer.input_layernorm, layer.post_attention_layernorm, attn.rope,
                   getattr(attn, "q_norm", None), getattr(attn, "k_norm", None))


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
    def __init__(self, loaded: LoadedModel, *, compiled: bool | None = None):
        """compiled: run plain decode steps compiled (None: compiled_step.default_on())."""
        lm = loaded.model
        self.loaded = loaded
        self.inner = lm.model
        self.blocks = list(lm.layers)
        model_type = loaded.config.get("model_type")
        self.ops = [LayerOps.from_layer(layer, dense=moe_module(layer) is None) for layer in self.blocks]
        self.mlps = [mlp_block(layer, ops, model_type) for layer, ops in zip(self.blocks, self.ops)]
        self.moe = [m if m.kind == "moe" else None for m in self.mlps]  # MoeBlock per layer, None if dense
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
        self.vector_rope = all(isinstance(layer.self_attn.rope, _VECTOR_ROPE) for layer in self.blocks)
        self.shared_rope = shared_rope([layer.self_attn.rope for layer in self.blocks])
        self.dtype = self.inner.norm.weight.dtype
        # each layer's modules, looked up once: an mlx.nn attribute goes through
        # Module.__getattr__ (a dict probe each), and a step asks for them over and over
        self.parts = [LayerParts.of(layer) for layer in self.blocks]
        self.embed, self.final_norm = self.inner.embed_tokens, self.inner.norm
        # memos of the native kernels' class signatures, shared by every run of this forward
        self.native_classes = NativeClassProbe(weights=loaded.weights_hash)
        self.attention_classes = AttentionClassProbe()
        # decode steps traced once per batch size and replayed (compiled_step.py); None: eager
        self.compiled: CompiledDecode | None = None
        self.set_compiled(compiled_default_on() if compiled is None else compiled)

    def set_compiled(self, on: bool) -> None:
        """Run plain native decode steps compiled (same bits: compiled_step.py) or eager."""
        if not on:
            self.compiled = None
        elif self.compiled is None:
            self.compiled = CompiledDecode(self)

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    def layer_linear_ops(self, layer: int) -> tuple[LinearOp, ...]:
        """Every dispatched linear op of a layer, in forward order (a MoE layer's router gate last)."""
        moe = self.moe[layer]
        return self.ops[layer].linear_ops() + ((moe.gate,) if moe is not None else ())

    def make_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        return PagedKVCache(self.num_layers, num_blocks, block_size, self.n_kv_heads, self.head_dim, self.dtype)

    def prepare(self, plan: StepPlan, blocks: BlockManager, dispatch: KernelDispatcher) -> PreparedStep:
        """Host side of a step (no MLX compute): safe to run while another step computes."""
        return prepare_step(plan, blocks, dispatch.attention_kernel(plan.index, batchable_count(plan)))

    def __call__(self, plan: StepPlan, cache: PagedKVCache, blocks: BlockManager, dispatch: KernelDispatcher, *,
                 keep_kv: bool = False, keep_routing: bool = False, tap: Tap | None = None,
                 tokens: mx.array | None = None) -> StepOutput:
        """tokens: the step's input ids when some are still on the device (the engine queues a
        step before the one feeding it has returned; the plan then holds placeholders)."""
        prep = self.prepare(plan, blocks, dispatch)
        if tokens is not None:
            prep.tokens = tokens
        return self.execute(prep, cache, dispatch, keep_kv=keep_kv, keep_routing=keep_routing, tap=tap)

    def execute(self, prep: PreparedStep, cache: PagedKVCache, dispatch: KernelDispatcher, *,
                keep_kv: bool = False, keep_routing: bool = False, tap: Tap | None = None) -> StepOutput:
        """Build the step's graph (lazy): logits of the logit rows, K/V written in place."""
        dispatch.begin_step(prep.plan.index)
        T, KV, hd = prep.rows, self.n_kv_heads, self.head_dim
        real = prep.real_rows  # padded rows (`padded`): taps, K/V and routing records see the plan's rows only
        if real is not None and tap is not None:
            tap = _real_rows_tap(tap, real, T)
        rotation = self._rotation(prep)
        if self.compiled is not None and self.compiled.usable(prep, dispatch, tap=tap, keep_routing=keep_routing):
            logits, k_all, v_all = self.compiled.run(prep, cache, dispatch, rotation, keep_kv=keep_kv, tap=tap)
            return StepOutput(logits, k_all, v_all)
        k_layers, v_layers = [], []
        routing = [] if keep_routing else None
        h = self.embed(prep.tokens)

        def rope(module, x):
            return self._rope(module, x, prep, rotation)

        for li in range(self.num_layers):
            q, k, v = self.pre_attention(li, h, dispatch, rope, tap, v_rows=prep.write_start is not None)
            cache.write(li, prep.write_slots, k, v, start=prep.write_start)
            if keep_kv:
                k_layers.append(k)
                v_layers.append(v)
            a = dispatch.attend(prep, li, q, cache, self.scale)
            h = self.post_attention(li, a, h, dispatch, routing, tap)
        if prep.logit_rows:
            if prep.logit_index is None or self._needed_rows_only(prep, h, dispatch):
                xn = self.final_norm(h if prep.logit_index is None else h[prep.logit_index])
                logits = dispatch(xn, self.head, self.num_layers)
            else:  # mlx-lm's shape: every row, then the ones needed (row_alone_is_exact)
                xn = self.final_norm(h)
                logits = dispatch(xn, self.head, self.num_layers)[prep.logit_index]
                xn = xn[prep.logit_index]
            if tap is not None:
                tap(self.num_layers, "norm", xn)
                tap(self.num_layers, "lm_head", logits)
        else:
            logits = mx.zeros((0, self.head.n), dtype=self.dtype)
        if real is not None and routing:
            routing = [LayerRouting(r.layer, r.experts[real], r.ranked[real], r.gate_input[real]) for r in routing]
        if keep_kv:  # [layers, T, KV, 1, hd] -> [layers, T, KV, hd]
            k_all = mx.stack(k_layers).reshape(self.num_layers, T, KV, hd)
            v_all = mx.stack(v_layers).reshape(self.num_layers, T, KV, hd)
            if real is not None:
                k_all, v_all = k_all[:, real], v_all[:, real]
            return StepOutput(logits, k_all, v_all, routing)
        return StepOutput(logits, routing=routing)

    def pre_attention(self, li: int, h: mx.array, dispatch, rope, tap: Tap | None = None, *,
                      v_rows: bool = True) -> tuple[mx.array, mx.array, mx.array]:
        """Layer li from the residual stream to attention's inputs: q, k [T, heads, 1, hd] after
        the input norm, the projections, q/k norms and `rope(module, x)`; v [T, KV, 1, hd]
        (v_rows) or [T, KV, hd], as the cache's write takes it (slice update / scatter).
        `dispatch(x, op, layer)` runs each linear op (the dispatcher, or compiled_step's tracer)."""
        parts, ops = self.parts[li], self.ops[li]
        T, H, KV, hd = h.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        x = parts.input_norm(h)
        q, k, v = dispatch(x, ops.q, li), dispatch(x, ops.k, li), dispatch(x, ops.v, li)
        if tap is not None:
            tap(li, "input_layernorm", x)
            tap(li, "q_proj", q)
            tap(li, "k_proj", k)
            tap(li, "v_proj", v)
        # [T, heads, 1, hd]: the layout RoPE and attention take, in one reshape; v as the
        # cache's write takes it with no further reshape (slice update / scatter)
        q, k = q.reshape(T, H, 1, hd), k.reshape(T, KV, 1, hd)
        v = v.reshape(T, KV, 1, hd) if v_rows else v.reshape(T, KV, hd)
        if self.has_qk_norm:  # over the last axis: the same bits in either layout
            q, k = parts.q_norm(q), parts.k_norm(k)
            if tap is not None:
                tap(li, "q_norm", q.reshape(T, H, hd))
                tap(li, "k_norm", k.reshape(T, KV, hd))
        q, k = rope(parts.rope, q), rope(parts.rope, k)
        if tap is not None:
            tap(li, "q_rope", q.reshape(T, H, hd))
            tap(li, "k_rope", k.reshape(T, KV, hd))
        return q, k, v

    def post_attention(self, li: int, a: mx.array, h: mx.array, dispatch, routing: list | None = None,
                       tap: Tap | None = None) -> mx.array:
        """Layer li from attention's output [T, heads * hd] to the next residual stream."""
        parts = self.parts[li]
        o = dispatch(a, self.ops[li].o, li)
        h = h + o
        if tap is not None:
            tap(li, "attention", a)
            tap(li, "o_proj", o)
            tap(li, "attn_residual", h)
        x = parts.post_norm(h)
        if tap is not None:
            tap(li, "post_attention_layernorm", x)
        h = h + self.mlps[li](x, dispatch, li, routing, tap=tap)
        if tap is not None:
            tap(li, "mlp_residual", h)
        return h

    def _needed_rows_only(self, prep: PreparedStep, h: mx.array, dispatch: KernelDispatcher) -> bool:
        """May the head compute only the rows whose logits are needed? Always for several rows
        (mlx-lm has no such shape to match: BatchGenerator pads) and for emulated kernels (they
        pick by row count themselves); a native lone row (a prefill's last) only where the
        backend was proved to give it the bits of the whole call's row."""
        if len(prep.logit_host) != 1:
            return True
        pol, T = dispatch.policy_for(self.head.name), h.shape[0]
        if pol.kernel_for(1) != NATIVE or pol.kernel_for(T) != NATIVE:
            return True
        return row_alone_is_exact(self.head, T, prep.logit_host[0], h.dtype)

    def _rotation(self, prep: PreparedStep) -> StepRotation | None:
        """The step's cos / sin, once for all layers, where RoPE is MLX's CPU fallback (rotary.py)."""
        if self.shared_rope is None or not fallback_in_use():
            return None
        return StepRotation(self.shared_rope, prep.positions, self.dtype, self.head_dim)

    def _rope(self, rope, x: mx.array, prep: PreparedStep, rotation: StepRotation | None) -> mx.array:
        """x [T, heads, 1, hd] at each row's own position."""
        if rotation is not None and x.dtype == self.dtype:
            return rotation.rotate(x)
        if x.shape[0] == 1:  # one row (a B=1 decode): a number offset, as mlx-lm's own call
            return rope(x, offset=prep.plan.slices[0].start)
        if self.vector_rope:
            return rope(x, offset=prep.positions)
        T, n, _, hd = x.shape
        x = x.reshape(T, n, hd)
        parts = []
        n = T // len(prep.plan.slices) if prep.real_rows is not None else 0  # padded: n rows per slice
        for i, s in enumerate(prep.plan.slices):  # one call per slice, the offset a number
            r0, count = (i * n, n) if n else (s.row_offset, s.count)
            xs = x[r0 : r0 + count].transpose(1, 0, 2)[None]
            parts.append(rope(xs, offset=s.start)[0].transpose(1, 0, 2)[:, :, None])
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)


def _real_rows_tap(tap: Tap, real: mx.array, rows: int) -> Tap:
    def seen(layer, point, x):
        tap(layer, point, x[real] if x.shape[0] == rows else x)
    return seen
