"""The first op whose output bits differ between A's and B's root-cause step.

Replay (analysis.replayer.op_outputs) records, for one request, every op's output
rows of one step on each side (norms, each linear op, RoPE, attention, SwiGLU,
residual adds, in forward order). Here the two recordings are compared position
by position: "layer 0 k_proj rows 9-12 differ first (max |Δ| 3.1e-3);
input_layernorm and q_proj equal". Pure numpy: the recordings are arrays.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..core.labels import span_text


@dataclass
class OpRows:
    """One side's recording: (layer, op) -> {position: float row}, and where each position sat."""

    step: int
    rows: dict[int, int]  # position -> row of the step's packed input
    outputs: dict[tuple[int, str], dict[int, np.ndarray]] = field(default_factory=dict)
    order: list[tuple[int, str]] = field(default_factory=list)  # (layer, op) in the order the forward ran them


@dataclass
class OpDifference:
    layer: int
    op: str
    positions: list[int]  # positions whose rows differ at that op
    rows_a: list[int]
    rows_b: list[int]
    max_abs_delta: float
    equal_before: list[str]  # ops of the same layer, before it, that were bitwise equal
    layers_equal: int  # layers before it whose every op was equal
    compared_positions: list[int]

    def text(self) -> str:
        eq = ""
        if self.equal_before:
            names = self.equal_before
            eq = "; " + (" and ".join(names) if len(names) <= 2 else ", ".join(names[:-1]) + " and " + names[-1]) \
                + " equal"
        before = f" (every op of layers 0-{self.layer - 1} equal)" if self.layers_equal else ""
        return (f"layer {self.layer} {self.op} rows {span_text(self.rows_b)} differ first "
                f"(max |Δ| {self.max_abs_delta:.2g}){eq}{before}")

    def to_json(self) -> dict:
        return {"layer": self.layer, "op": self.op, "positions": self.positions, "rows_a": self.rows_a,
                "rows_b": self.rows_b, "max_abs_delta": self.max_abs_delta, "equal_before": self.equal_before,
                "compared_positions": self.compared_positions, "text": self.text()}


@dataclass(frozen=True)
class FirstOp:
    """What comparing the two root-cause steps op by op found for one request (--ops): the
    first op that differed, or None and why none is named."""

    difference: OpDifference | None
    detail: str = ""


def first_op_difference(a: OpRows, b: OpRows, only=None) -> OpDifference | None:
    """The first (layer, op), in B's forward order, where a position both sides computed
    has other bits; None when every recorded op is equal on the common positions.
    only: compare just these positions (the cause's), where both sides computed them."""
    common = sorted(set(a.rows) & set(b.rows))
    if only:
        narrowed = [p for p in common if p in set(only)]
        common = narrowed or common
    if not common:
        return None
    equal_in_layer: list[str] = []
    layer_now = None
    for key in b.order:
        layer, op = key
        if layer != layer_now:
            layer_now, equal_in_layer = layer, []
        xa, xb = a.outputs.get(key), b.outputs.get(key)
        if xa is None or xb is None:
            continue
        pos = [p for p in common if p in xa and p in xb]
        if not pos:
            continue
        ra = np.stack([xa[p] for p in pos])
        rb = np.stack([xb[p] for p in pos])
        if ra.shape != rb.shape:
            continue
        bad = (_bits(ra) != _bits(rb)).reshape(len(pos), -1).any(axis=1)
        if not bad.any():
            equal_in_layer.append(op)
            continue
        diffp = [p for p, x in zip(pos, bad) if x]
        delta = np.abs(ra.astype(np.float64) - rb.astype(np.float64))
        delta = delta[np.isfinite(delta)]
        return OpDifference(layer, op, diffp, [a.rows[p] for p in diffp], [b.rows[p] for p in diffp],
                            float(delta.max()) if delta.size else 0.0, list(equal_in_layer), layer, common)
    return None


def _bits(x: np.ndarray) -> np.ndarray:
    width = {2: np.uint16, 4: np.uint32, 8: np.uint64, 1: np.uint8}[x.dtype.itemsize]
    return np.ascontiguousarray(x).view(width)
