"""The one place that decides which kernel runs each linear op and each attention, and says so.

A `KernelPolicy` maps a row count (and shape) to a kernel, and a step's number of
decode slices to an attention kernel. The `KernelDispatcher` applies it to every
linear op and every layer's attention of a step, honours per-step and per-op forcing
(replay), and emits a `KernelChoice` event for each decision: to an `emit` with a
`row(step, fields)` method (the engine's step buffer) as its fields but step, one tuple
shared by every step whose op has the same fields (core/events.py StepKernels), else
as a KernelChoice.

Tensor parallelism: the dispatcher is given the rank's group (`parallel`, see
divergence/parallel/group.py). A LinearOp marked sharded-to-all is then followed by the
group's `reduce_partial`, whose AllReduce event goes out through `emit` like a kernel
choice; a step forced UNSHARDED runs sharded ops through `run_unsharded` instead.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

import mlx.core as mx

from . import attention, linear as kernels
from ...core.events import AllReduce, KernelChoice, kernel_choice
from ...core.names import ATTENTION, LINEAR_OPS, SHARDED_TO_ALL
from . import splits as cpu_split
from .linear import LinearOp
from .kv_reads import HeadSlice
from .native_classes import AttentionClassProbe, NativeClassProbe
from ...core.policy import BATCH_INVARIANT, GEMM, GEMV, NATIVE, KernelPolicy, SoloStep, UnshardedStep

__all__ = ["KernelDispatcher", "KernelPolicy"]

# query-key pairs (sum over the step's slices of rows x KV length, x query heads) from which a
# step's attention is split by KV heads across CPU streams: below it the work saved is smaller
# than the cross-stream wait the split adds (a 64-row prefill of 4 heads is 16k)
HEAD_SPLIT_PAIRS = 1 << 14
# Only where MLX's own matmul runs SDPA's products (simd_gemm: each output a fixed-order sum,
# whatever M). With one KV head per group MLX folds the query heads sharing it into one product
# of twice the rows, and fp32 products go to the BLAS, whose bits depend on M: fp32 runs came
# out different (OpenBLAS, Prescott kernels), so fp32 is never split.
_HEAD_SPLIT_DTYPES = (mx.bfloat16, mx.float16)

class KernelDispatcher:
    """Runs linear ops for one model under a policy; emits KernelChoice events."""

    def __init__(self, policy: KernelPolicy, model: str,
                 emit: Callable[[KernelChoice | AllReduce], None] | None = None,
                 classes: NativeClassProbe | None = None, attention_classes: AttentionClassProbe | None = None,
                 parallel=None):
        self.policy = policy
        self.model = model
        self.emit = emit
        # the emit's columnar entry (its step's rows), when it has one
        self._row: Callable[[int, tuple], None] | None = getattr(emit, "row", None)
        # Replay forcing: step -> policy for the whole step, {op name: policy} for some ops,
        # or SOLO (each request of the step alone, run's own policy; the engine splits the step).
        self.forced: dict[int, KernelPolicy | dict[str, KernelPolicy] | SoloStep] = {}
        self._step = -1
        self._unsharded: frozenset = frozenset()
        # class signatures of native ops, for the trace; the forward's own probe when given,
        # so signatures are measured once per model, not once per run
        self.classes = classes or NativeClassProbe()
        self.attention_classes = attention_classes or AttentionClassProbe()
        self._step_policy: KernelPolicy | dict[str, KernelPolicy] = policy
        self.parallel = parallel  # the TP group (None: one device, nothing to reduce)
        self._attn_row: tuple = ()  # this step's attention fields but step (layer 0's; when recording)
        self._attn_key: tuple = ()  # (step, id(prep)) they are of
        self._split, self._split_key = None, ()  # this step's attention head split (see _head_split)
        self._plain = self._native = False
        # (id(op), layer, m, kernel, splits, dtype) -> (op, the KernelChoice fields but step):
        # see _record
        self._protos: dict[tuple, tuple[LinearOp, tuple]] = {}

    @property
    def _onerow(self) -> str:
        """How a one-row attention call reads K/V on the GPU (attention.attend): under the
        policies that promise a sequence's bits whatever the batch, the layout whose kernel
        is the same every run; under the others, mlx-lm's (generate_step's numbers)."""
        return attention.STABLE if self.policy.name in (BATCH_INVARIANT, GEMV) else attention.MLXLM

    def begin_step(self, step: int) -> None:
        self._step = step
        forced = self.forced.get(step, self.policy)
        # STEP:unsharded (every sharded op) or STEP:OP=unsharded: those ops on the full weights
        self._unsharded = frozenset()
        if isinstance(forced, UnshardedStep):
            self._unsharded = frozenset(LINEAR_OPS)
        elif isinstance(forced, dict) and any(isinstance(p, UnshardedStep) for p in forced.values()):
            self._unsharded = frozenset(o for o, p in forced.items() if isinstance(p, UnshardedStep))
            forced = {o: p for o, p in forced.items() if not isinstance(p, UnshardedStep)}
        self._step_policy = self.policy if isinstance(forced, (SoloStep, UnshardedStep)) else forced
        # every linear op of this step is the module's own call, with nothing to record or
        # reduce: skip the per-op policy lookups (~170 ops per step on a 24-layer model)
        sp = self._step_policy
        native = (isinstance(sp, KernelPolicy) and sp.threshold is None and sp.kernel_for(1) == NATIVE
                  and self.parallel is None and not self._unsharded)
        self._plain = native and self.emit is None
        self._native = native and self.emit is not None  # the same, each op recorded (see __call__)

    @property
    def all_native(self) -> bool:
        """Does every linear op of this step run its module's own call (native, nothing forced,
        one device)? Then a compiled step may run them (model/compiled_step.py)."""
        return self._plain or self._native

    @property
    def recording(self) -> bool:
        """Are this step's native ops recorded (an emit is set)? See record_native."""
        return self._native

    def record_native(self, op: LinearOp, layer: int, m: int, dtype) -> None:
        """The record of a native op a compiled step ran: what __call__ records for it."""
        self._record(op, layer, m, NATIVE, 1, dtype)

    @property
    def step(self) -> int:
        """The step being executed (ops outside this module record it too: MoE experts)."""
        return self._step

    def solo(self, step: int) -> bool:
        """Is this step forced to run each of its requests alone?"""
        return isinstance(self.forced.get(step), SoloStep)

    def policy_for(self, op_name: str) -> KernelPolicy:
        sp = self._step_policy
        return sp.get(op_name, self.policy) if isinstance(sp, dict) else sp

    def attention_kernel(self, step: int, decode_slices: int) -> str:
        """The attention kernel of step `step` (forcing included), without entering the
        step: the host may prepare a step while the previous one is still being built."""
        forced = self.forced.get(step, self.policy)
        if isinstance(forced, (SoloStep, UnshardedStep)):
            forced = self.policy
        pol = forced.get(ATTENTION, self.policy) if isinstance(forced, dict) else forced
        if not isinstance(pol, KernelPolicy):  # attention=unsharded: attention is never sharded across ranks
            pol = self.policy
        return pol.attention_kernel(decode_slices)

    def attend(self, prep, layer: int, q: mx.array, cache, scale: float) -> mx.array:
        """One layer's attention for the prepared step (its kernel was chosen at prepare
        time), recorded as op `attention`: m = query rows, n = sequences, k = the longest
        KV length, kv_min = the shortest; native_class = the kernel's probed class."""
        split = self._head_split(prep, q, cache)
        out = attention.attend(prep, layer, q, cache, scale, self._onerow) if split is None else \
            _by_heads(prep, layer, q, cache, scale, split, self._onerow)
        if self.emit is not None:
            if layer == 0 or self._attn_key != (self._step, id(prep)):  # (the same for every layer of a step)
                self._attn_key = (self._step, id(prep))
                sig = self._attention_signature(prep, q, cache.kv_heads)
                T, lens = prep.attended_rows, prep.kv_lens
                row = self._attn_row = (self.model, layer, ATTENTION, T, prep.kernel, T, len(lens), max(lens), 1, sig,
                                        -1, min(lens))
            else:
                r = self._attn_row
                row = (r[0], layer) + r[2:]
            if self._row is not None:
                self._row(self._step, row)
            else:
                self.emit(kernel_choice(self._step, row))
        return out

    def _head_split(self, prep, q: mx.array, cache):
        """The CPU column split (splits.py) where this step's attention runs one KV head group
        per stream: bf16 / fp16, whose SDPA kernels are MLX's single-threaded loops (see
        _HEAD_SPLIT_DTYPES), with KV heads to share out and enough work (HEAD_SPLIT_PAIRS
        query-key pairs) for the cross-stream wait."""
        if self.parallel is not None or cache.kv_heads < 2 or not cpu_split.MAY_SPLIT:
            return None
        key = (prep.plan.index, id(prep))
        if self._split_key != key:
            self._split_key = key
            split = cpu_split.process_split()
            pairs = sum(s.count * (s.start + s.count) for s in prep.plan.slices) * q.shape[1]
            self._split = split if split is not None and q.dtype in _HEAD_SPLIT_DTYPES and q.dtype in split.dtypes \
                and pairs >= HEAD_SPLIT_PAIRS else None
        return self._split

    def _attention_signature(self, prep, q: mx.array, kv_heads: int) -> int:
        """Class of the step's decode attention: per-seq at its query rows, or batched at
        its batch size. 0 (no class) for steps without decode / verify slices."""
        queries = prep.decode_queries
        if not queries:
            return 0
        _, heads, _, head_dim = q.shape
        layout = next((g.layout for g in prep.groups if g.batched), "right")
        return self.attention_classes.signature(prep.kernel, prep.batch, heads, kv_heads, head_dim, queries, q.dtype,
                                                layout=layout)

    def __call__(self, x: mx.array, op: LinearOp, layer: int) -> mx.array:
        if self._plain:
            return op.native(x)
        if self._native:  # run_kernel's native branch and event, without its per-op policy lookups
            out = kernels.run_native(x, op)
            self._record(op, layer, x.shape[0], NATIVE, 1, x.dtype)
            return out
        if op.name in self._unsharded and op.shard is not None and self.parallel is not None:
            return self.parallel.run_unsharded(self, x, op, layer)  # the full op, through run_kernel
        return self.run_kernel(x, op, layer)

    def run_kernel(self, x: mx.array, op: LinearOp, layer: int) -> mx.array:
        m = x.shape[0]
        policy = self.policy_for(op.name)
        kernel = policy.kernel_for(m)
        splits = 1
        if kernel == GEMM:
            group = op.module.group_size if op.quantized else 1
            splits = policy.splits or kernels.gemm_splits(m, op.n, op.k, group=group)
            out = kernels.run_gemm(x, op, splits)
        elif kernel == GEMV:
            out = kernels.run_gemv(x, op)
        elif kernel == BATCH_INVARIANT:
            out = kernels.run_batch_invariant(x, op)
        else:
            out = kernels.run_native(x, op)
        if self.parallel is not None and op.shard == SHARDED_TO_ALL:
            out, reduced = self.parallel.reduce_partial(self, out, op, layer)
            if self.emit is not None:
                self.emit(reduced)
        if self.emit is not None:
            self._record(op, layer, m, kernel, splits, x.dtype)
        return out

    def _record(self, op: LinearOp, layer: int, m: int, kernel: str, splits: int, dtype) -> None:
        """This step's kernel choice of an op, emitted: its fields but step (and the native class
        signature) memoized as one tuple, which a columnar emit (`row`) takes as it is: no
        KernelChoice (a frozen dataclass) is made per op, and a step has one per op and layer
        (over a hundred on a 24-layer model)."""
        key = (id(op), layer, m, kernel, splits, dtype)
        got = self._protos.get(key)
        if got is None or got[0] is not op:  # (an id is only reused once its op is gone)
            sig = self.classes.signature(op, m, dtype) if kernel == NATIVE else 0
            got = self._protos[key] = (op, (self.model, layer, op.name, m, kernel, m, op.n, op.k, splits, sig, -1, 0))
        if self._row is not None:
            self._row(self._step, got[1])
        else:
            self.emit(kernel_choice(self._step, got[1]))


def _by_heads(prep, layer: int, q: mx.array, cache, scale: float, split, onerow: str) -> mx.array:
    """attention.attend in KV head groups, one per stream of the split (the first on the caller's),
    joined along the features: each query head reads one KV head, so every group computes its
    heads' outputs from the same values, in calls of the same shapes per head, as the whole call
    does (bits unchanged: whole bf16 runs compared split and unsplit, tokens, top-k logits and
    KV hashes, under the mlx-lm, whole and padded layouts)."""
    kv = cache.kv_heads
    parts = min(split.parts, kv)
    per_q = q.shape[1] // kv  # query heads per KV head
    edges = [kv * i // parts for i in range(parts + 1)]
    outs = []
    for i, (h0, h1) in enumerate(zip(edges, edges[1:])):
        view = HeadSlice(cache, h0, h1)
        with mx.stream(split.streams[i - 1]) if i else nullcontext():
            outs.append(attention.attend(prep, layer, q[:, h0 * per_q : h1 * per_q], view, scale, onerow))
    return mx.concatenate(outs, axis=-1)
