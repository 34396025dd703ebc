"""What a step was, read from a trace (StepView: its rows, who was in it, which kernels
ran), and the op whose kernel differs between two steps."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..core.labels import kernel_label
from ..core.names import ATTENTION


WRITE_OPS = ("k_proj", "v_proj")  # the ops whose output is written to the cache


@dataclass
class StepView:
    """What a step was: rows, who was in it, which kernels ran."""

    step: int
    rows: int
    composition: list[dict]  # request_id, phase, start, count, row_offset
    kernel: str  # label of the op named by the root cause, e.g. "gemm/4"
    kernels: dict  # op -> kernel label (first layer where the op ran; lm_head included)
    # op -> (rows, native class signature) where the op ran natively (see engine.kernels.native_classes)
    native: dict = field(default_factory=dict)
    attention_class: int = 0  # probed class of the step's attention kernel; 0 = unknown / no decode rows

    def to_json(self) -> dict:
        return {"step": self.step, "rows": self.rows, "composition": self.composition,
                "kernel": self.kernel, "kernels": self.kernels}


def step_kernels(trace, step: int) -> dict[str, str]:
    """op -> kernel label of one step (ops in forward order, lm_head last)."""
    return _labels(trace.kernels(step=step))


def _labels(ks: dict) -> dict[str, str]:
    out: dict[str, str] = {}
    for op, kernel, splits in zip(ks["op"], ks["kernel"], ks["splits"]):
        out.setdefault(str(op), kernel_label(str(kernel), int(splits)))
    return out


def _native_classes(ks: dict) -> dict[str, tuple[int, int]]:
    """op -> (rows, native class signature) for the ops of one step that ran natively."""
    out: dict[str, tuple[int, int]] = {}
    for op, rows, cls in zip(ks["op"], ks["rows"], ks["native_class"]):
        if int(cls) and op != ATTENTION:
            out.setdefault(str(op), (int(rows), int(cls)))
    return out


def _attention_class(ks: dict) -> int:
    sel = np.flatnonzero(np.asarray(ks["op"]) == ATTENTION)
    return int(ks["native_class"][sel[0]]) if len(sel) else 0


def _attention_differs(a: "StepView", b: "StepView") -> bool:
    """Attention counts as changed unless both classes are known and equal (a batched call
    that the probe showed bitwise equal to per-sequence calls changed nothing)."""
    if a.kernels.get(ATTENTION) == b.kernels.get(ATTENTION):
        return bool(a.attention_class and b.attention_class and a.attention_class != b.attention_class)
    return not (a.attention_class and a.attention_class == b.attention_class)


def native_class_changes(a: StepView, b: StepView) -> dict[str, tuple[int, int]]:
    return {op: (a.native[op][0], rb) for op, (rb, cb) in b.native.items()
            if op in a.native and a.native[op][1] != cb}


def step_view(trace, step: int) -> StepView:
    plan = trace.step_plan(step)
    comp = [{"request_id": s.request_id, "phase": s.phase, "start": s.start, "count": s.count,
             "row_offset": s.row_offset} for s in plan.slices]
    ks = trace.kernels(step=step)  # read once: labels and native classes come from the same records
    return StepView(step, plan.rows, comp, "?", _labels(ks), _native_classes(ks), _attention_class(ks))


def _name_op(a: StepView, b: StepView, prefer=WRITE_OPS) -> str | None:
    """The op whose kernel differs between the two steps (the K/V writers first): by label,
    else (both native) by probed kernel class. None when both ran natively and no linear
    op changed class: the row-count dependence is in another op (attention, norms)."""
    ops = [o for o in b.kernels if o != ATTENTION and a.kernels.get(o) != b.kernels.get(o)]
    if not ops and a.native and b.native:
        ops = list(native_class_changes(a, b))
    if not ops and ATTENTION in b.kernels and _attention_differs(a, b):
        ops = [ATTENTION]
    if not ops and a.native and b.native:
        return None
    for o in prefer:
        if o in ops:
            return o
    return ops[0] if ops else (prefer[0] if prefer[0] in b.kernels else next(iter(b.kernels), None))


def step_views(a, b, step_a: int, step_b: int, prefer=WRITE_OPS) -> tuple[StepView, StepView, str | None]:
    va, vb = step_view(a, step_a), step_view(b, step_b)
    op = _name_op(va, vb, prefer)
    va.kernel, vb.kernel = va.kernels.get(op, "native" if va.native else "?"), \
        vb.kernels.get(op, "native" if vb.native else "?")
    return va, vb, op
