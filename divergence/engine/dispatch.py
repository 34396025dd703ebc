"""The one place that decides which kernel runs each linear op, and says so.

A `KernelPolicy` maps a row count (and shape) to a kernel. The
`KernelDispatcher` applies it to every linear op of a step, honours per-step
forcing (replay), and emits a `KernelChoice` event for each decision.

Tensor parallelism: a LinearOp marked sharded-to-all is followed by `all_reduce(out,
op, layer)` when one is set (None: one device, nothing to reduce); a step forced
UNSHARDED runs sharded ops through `unsharded(x, op, layer)` instead (engine/tp.py).
"""
from __future__ import annotations

from typing import Callable

import mlx.core as mx

from . import kernels
from ..core.events import KernelChoice
from ..core.names import LINEAR_OPS, SHARDED_TO_ALL
from .kernels import LinearOp
from .native_classes import NativeClassProbe
from ..core.policy import BATCH_INVARIANT, GEMM, GEMV, NATIVE, KernelPolicy, SoloStep, UnshardedStep

__all__ = ["KernelDispatcher", "KernelPolicy"]

class KernelDispatcher:
    """Runs linear ops for one model under a policy; emits KernelChoice events."""

    def __init__(self, policy: KernelPolicy, model: str, emit: Callable[[KernelChoice], None] | None = None,
                 classes: NativeClassProbe | None = None):
        self.policy = policy
        self.model = model
        self.emit = emit
        # Replay forcing: step -> policy for the whole step, {op name: policy} for some ops,
        # or SOLO (each request of the step alone, run's own policy; the engine splits the step).
        self.forced: dict[int, KernelPolicy | dict[str, KernelPolicy] | SoloStep] = {}
        self._step = -1
        self._unsharded: frozenset = frozenset()
        # class signatures of native ops, for the trace; the forward's own probe when given,
        # so signatures are measured once per model, not once per run
        self.classes = classes or NativeClassProbe()
        self._step_policy: KernelPolicy | dict[str, KernelPolicy] = policy
        self.all_reduce: Callable[[mx.array, LinearOp, int], mx.array] | None = None
        self.unsharded: Callable[[mx.array, LinearOp, int], mx.array] | None = None

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

    def __call__(self, x: mx.array, op: LinearOp, layer: int) -> mx.array:
        if op.name in self._unsharded and op.shard is not None and self.unsharded is not None:
            return self.unsharded(x, op, layer)  # runs the full op through run_kernel
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
        if self.all_reduce is not None and op.shard == SHARDED_TO_ALL:
            out = self.all_reduce(out, op, layer)
        if self.emit is not None:
            sig = self.classes.signature(op, m, x.dtype) if kernel == NATIVE else 0
            self.emit(KernelChoice(self._step, self.model, layer, op.name, m, kernel, m, op.n, op.k, splits, sig))
        return out
