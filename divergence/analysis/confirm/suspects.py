"""Which of B's steps a confirmation forces beyond the cause's: those whose K/V the divergent
row read differently from A's, and for a sampled token the draft's steps."""
from __future__ import annotations

from ..bisect import draft_step
from ..forcing import rows_per_op
from ..step_view import step_kernels


def suspect_steps(a, b, rid: str, pos: int, step_a: int, step_b: int, model: str = "target") -> dict[int, int]:
    """B step -> A step: the step that computed the divergent row (predicting `pos`), and
    every step that wrote K/V it read differently from A's (their rows or kernels differ)."""
    pairs: dict[int, int] = {step_b: step_a}
    la = a.live_kv(rid, model=model, at_step=step_a)
    lb = b.live_kv(rid, model=model, at_step=step_b)
    a_cell = {(int(l), int(p)): (int(s), int(k), int(v))
              for l, p, s, k, v in zip(la["layer"], la["position"], la["step"], la["k_hash"], la["v_hash"]) if p < pos}
    for l, p, s, k, v in zip(lb["layer"], lb["position"], lb["step"], lb["k_hash"], lb["v_hash"]):
        got = a_cell.get((int(l), int(p)))
        if p < pos and got is not None and (got[1], got[2]) != (int(k), int(v)):
            pairs.setdefault(int(s), got[0])
    # native labels hide row-count classes: a native step whose rows differ is a suspect too
    return {sb: sa for sb, sa in sorted(pairs.items())
            if step_kernels(a, sa) != step_kernels(b, sb) or rows_per_op(a, sa) != rows_per_op(b, sb)
            or sb == step_b}


def is_greedy(trace, rid: str) -> bool:
    return next(r for r in trace.requests if r.id == rid).sampling.greedy


def draft_pairs(a, b, rid: str, until_a: int, until_b: int) -> dict[int, int]:
    """B draft step -> A draft step, for B's draft steps of the request up to the flip, each
    paired with A's latest draft step that predicted the same position (its q)."""
    out: dict[int, int] = {}
    for plan in b.iter_plans():
        if plan.model != "draft" or plan.index >= until_b:
            continue
        for s in plan.slices:
            if s.request_id == rid:
                sa = draft_step(a, rid, s.start + s.count, until_a)
                if sa is not None and (step_kernels(a, sa) != step_kernels(b, plan.index)
                                       or rows_per_op(a, sa) != rows_per_op(b, plan.index)):
                    out[plan.index] = sa
    return out
