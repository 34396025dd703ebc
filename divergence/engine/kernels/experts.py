"""The experts' matmuls (SwiGLU: up, gate, down per selected expert) under each kernel.

`native` is mlx-lm's SwitchGLU exactly (gather_mm / gather_qmm over every
(token, expert) pair, sorted by expert when there are >= 64 of them; on a
backend without a dense gather_mm in the model's dtype, mlx's CPU in bf16 /
fp16, the backend's matmul on each expert's rows, since mlx-lm has no
numbers there to match). The
others group the pairs by expert, as grouped-GEMM MoE kernels do, so what an
expert's kernel sees is the rows it received this step, which depend on the
whole batch: `gemv` runs each pair alone (one row), `gemm` a split-K product
over the expert's rows (split from the (rows, N, K) shape, the same split for
the three matmuls, so `gemm:S` replays it), `batch-invariant` the expert's own
op on fixed 8-row tiles. Under `threshold:N` each expert picks gemv or gemm
from its own row count. One KernelChoice per expert that received rows.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.activations import swiglu

from ...core.events import KernelChoice
from ...core.names import BATCH_INVARIANT, EXPERTS, GEMM, GEMV, NATIVE
from . import linear as kernels
from .linear import LinearOp


class ExpertLinear:
    """Expert e of a SwitchLinear / QuantizedSwitchLinear, shaped like a Linear for kernels.py:
    `weight` (and `scales`, `biases`) are expert e's [out, in] slices; calling it runs the
    switch layer's own gather op on expert e for a block of rows (one matrix product)."""

    def __init__(self, switch, e: int):
        self.switch = switch
        self.e = e
        self._idx = mx.array([e], dtype=mx.uint32)
        self.weight = switch.weight[e]
        self.quantized = hasattr(switch, "scales")
        if self.quantized:
            self.scales = switch.scales[e]
            b = switch.get("biases") if hasattr(switch, "get") else None
            self.biases = b[e] if b is not None else None
            self.group_size, self.bits = switch.group_size, switch.bits
            self.mode = getattr(switch, "mode", "affine")
        self.bias = switch["bias"][e] if "bias" in switch else None

    def __contains__(self, name: str) -> bool:
        return getattr(self, name, None) is not None

    @property
    def splittable(self) -> bool:
        """Can cpu_split compute it in column parts (`part`)? Not a quantized expert: its own op
        is the switch layer's gather_qmm, which the split's quantized_matmul is not."""
        return not self.quantized

    def __call__(self, x: mx.array) -> mx.array:
        sw = self.switch
        if self.quantized:
            y = mx.gather_qmm(x[None], sw["weight"], sw["scales"], sw.get("biases"), rhs_indices=self._idx,
                              transpose=True, group_size=sw.group_size, bits=sw.bits, mode=sw.mode,
                              global_scale=getattr(sw, "global_scale", None))[0]
        else:  # the backend's matmul on this expert's rows (gather_mm is float32-only on mlx's CPU)
            y = x @ self.weight.T
        return y + self.bias if self.bias is not None else y

    def part(self, x: mx.array, n0: int, n1: int, stream) -> mx.array:
        """Output columns n0:n1 of __call__, the same ops on `stream` (cpu_split's parts)."""
        assert not self.quantized, "a quantized expert is not split"
        y = mx.matmul(x, self.weight[n0:n1].T, stream=stream)
        return y if self.bias is None else mx.add(y, self.bias[n0:n1], stream=stream)


_GATHER_OK: dict[tuple, bool] = {}


def gather_mm_supported(dtype) -> bool:
    """Can the default device run a dense gather_mm in this dtype? (mlx 0.32's CPU backend:
    float32 only, so mlx-lm cannot run a bf16 / fp16 MoE model there at all.)"""
    key = (str(mx.default_device()), str(dtype))
    if key not in _GATHER_OK:
        try:
            a, b = mx.zeros((1, 1, 1, 8), dtype=dtype), mx.zeros((2, 8, 8), dtype=dtype)
            mx.eval(mx.gather_mm(a, b, rhs_indices=mx.array([[1]], dtype=mx.uint32)))
            _GATHER_OK[key] = True
        except (RuntimeError, ValueError):
            _GATHER_OK[key] = False
    return _GATHER_OK[key]


class ExpertWeights:
    """A SwitchGLU's experts, each as three LinearOps (views made on first use)."""

    def __init__(self, switch_glu):
        self.module = switch_glu
        self.num_experts = int(switch_glu.gate_proj.weight.shape[0])
        up = switch_glu.up_proj
        self.hidden = int(up.input_dims)
        self.inter = int(up.output_dims)
        self.quantized = hasattr(up, "scales")
        self.group = int(getattr(up, "group_size", 1)) if self.quantized else 1
        self._ops: dict[int, tuple[LinearOp, LinearOp, LinearOp]] = {}

    def ops(self, e: int) -> tuple[LinearOp, LinearOp, LinearOp]:
        """(up, gate, down) of expert e."""
        if e not in self._ops:
            m = self.module
            self._ops[e] = (LinearOp(EXPERTS, ExpertLinear(m.up_proj, e), self.inter, self.hidden),
                            LinearOp(EXPERTS, ExpertLinear(m.gate_proj, e), self.inter, self.hidden),
                            LinearOp(EXPERTS, ExpertLinear(m.down_proj, e), self.hidden, self.inter))
        return self._ops[e]


def _run(kernel: str, x: mx.array, op: LinearOp, splits: int) -> mx.array:
    if kernel == GEMM:
        return kernels.run_gemm(x, op, splits)
    if kernel == GEMV:
        return kernels.run_gemv(x, op)
    if kernel == BATCH_INVARIANT:
        return kernels.run_batch_invariant(x, op)
    return op.native(x)  # native on one expert's rows: one product of all of them


def expert_swiglu(x: mx.array, ops, kernel: str, splits: int) -> mx.array:
    """One expert's SwiGLU on its rows, in SwitchGLU's order (up, gate, activation, down)."""
    up, gate, down = ops
    x_up = _run(kernel, x, up, splits)
    x_gate = _run(kernel, x, gate, splits)
    return _run(kernel, swiglu(x_gate, x_up), down, splits)


def run_experts(x: mx.array, inds: mx.array, experts: ExpertWeights, dispatch, layer: int) -> mx.array:
    """[T, hidden] rows, [T, k] expert indices -> [T, k, hidden] expert outputs."""
    policy = dispatch.policy_for(EXPERTS)
    emit = dispatch.emit
    # native = mlx-lm's SwitchGLU; where the backend has no dense gather_mm for the dtype,
    # native is the backend's matmul on each expert's rows (grouped, below)
    if policy.threshold is None and policy.name == NATIVE and (experts.quantized or gather_mm_supported(x.dtype)):
        y = experts.module(x, inds)
        if emit is not None:  # the rows each expert received (reading them waits for the router)
            counts = np.bincount(np.array(inds).reshape(-1), minlength=experts.num_experts)
            for e in np.flatnonzero(counts):
                c = int(counts[e])
                emit(KernelChoice(dispatch.step, dispatch.model, layer, EXPERTS, c, NATIVE, c, experts.inter,
                                  experts.hidden, 1, 0, int(e)))
        return y
    t, k = inds.shape
    flat = np.array(inds).reshape(-1)  # pair p = (token p // k, slot p % k)
    order = np.argsort(flat, kind="stable")
    ids, counts = np.unique(flat[order], return_counts=True)
    outs, off = [], 0
    for e, c in zip(ids.tolist(), counts.tolist()):
        rows = order[off: off + c] // k
        off += c
        kernel = policy.kernel_for(c)
        splits = 1
        if kernel == GEMM:
            splits = policy.splits or kernels.gemm_splits(c, experts.inter, experts.hidden, group=experts.group)
        xe = x[mx.array(rows.astype(np.int32))]
        outs.append(expert_swiglu(xe, experts.ops(e), kernel, splits))
        if emit is not None:
            emit(KernelChoice(dispatch.step, dispatch.model, layer, EXPERTS, c, kernel, c, experts.inter,
                              experts.hidden, splits, 0, int(e)))
    y = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
    inv = np.empty_like(order)
    inv[order] = np.arange(order.size)
    return y[mx.array(inv.astype(np.int32))].reshape(t, k, -1)
