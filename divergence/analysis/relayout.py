"""Relayout: the step plans of a replay in which one request's slice of a step covers
other positions (the confirming replay that makes B's step compute what A's did,
forcing.py), and the token sites whose logit rows moved with it. Pure data: the
engine runs the plans it is given (engine/replay.py)."""
from __future__ import annotations

from dataclasses import replace

from ..core.events import DRAFT_MODEL, StepPlan
from ..core.policy import SOLO, RelayoutStep


def first_starts(plans: list[StepPlan]) -> dict[tuple[str, str], int]:
    """(model, request) -> the start of the request's first slice."""
    out: dict[tuple[str, str], int] = {}
    for p in plans:
        for s in p.slices:
            out.setdefault((p.model, s.request_id), s.start)
    return out


def admissions(recorded: list[StepPlan], plans: list[StepPlan]) -> dict[tuple[str, str], int]:
    """Where a relayout recomputes part of a prefix hit (its first slice now starts past 0
    but before the recorded hit), the request is still admitted at the recorded hit and
    writes over the shared blocks: (model, request) -> that start."""
    was = first_starts(recorded)
    return {key: was[key] for key, start in first_starts(plans).items() if 0 < start < was[key]}


def relayout(plans: list[StepPlan], sites: list, forced: dict, requests) -> tuple[list, list, dict]:
    """Apply each RelayoutStep: at its step the request's slice covers [start, end) (input
    tokens from the prompt and the plans), its slices in later target steps lose those
    positions (a step left empty is dropped), and the token sites whose logit rows moved
    follow them. The dispatcher sees SOLO for the step. Returns (plans, sites, forced)."""
    todo = {k: v for k, v in forced.items() if isinstance(v, RelayoutStep)}
    if not todo:
        return plans, sites, forced
    token_at: dict[tuple[str, int], int] = {}
    for r in requests:
        for i, t in enumerate(r.prompt_tokens):
            token_at[(r.id, i)] = int(t)
    for p in plans:
        if p.model != DRAFT_MODEL:
            for s in p.slices:
                for i, t in enumerate(s.tokens):
                    token_at.setdefault((s.request_id, s.start + i), int(t))
    moved: dict[tuple[str, int], int] = {}  # (request, predicted position) -> the step that now computes it
    # request -> [(step, start, end)]: the spans already computed ahead (a prefill laid out as
    # the other trace's chunks is several relayouts of one request, one a step)
    taken: dict[str, list[tuple[int, int, int]]] = {}
    out = []
    for p in plans:
        rl = todo.get(p.index)
        slices, row = [], 0
        for s in p.slices:
            if p.model != DRAFT_MODEL and rl is not None and s.request_id == rl.request_id:
                predicted = {s.start + lr + 1 for lr in s.logit_rows}
                # logit rows of later slices inside the new spans come here too
                for q in plans:
                    if q.index > p.index and q.model != DRAFT_MODEL:
                        for t in q.slices:
                            if t.request_id == s.request_id:
                                predicted |= {t.start + lr + 1 for lr in t.logit_rows
                                              if any(a <= t.start + lr < b for a, b in rl.spans)}
                # one slice per pass, in order (the step runs request by request: SOLO runs each
                # slice as its own forward pass)
                for a, b in rl.spans:
                    toks = tuple(token_at[(s.request_id, x)] for x in range(a, b))
                    rows = tuple(sorted(x - 1 - a for x in predicted if a <= x - 1 < b))
                    for x in predicted:
                        if a <= x - 1 < b:  # the rows this pass computes
                            moved[(s.request_id, x)] = p.index
                    slices.append(replace(s, start=a, count=b - a, tokens=toks, logit_rows=rows, row_offset=row))
                    row += b - a
                    taken.setdefault(s.request_id, []).append((p.index, a, b))
                continue
            elif p.model != DRAFT_MODEL and s.request_id in taken:
                spans = [(lo, hi) for at, lo, hi in taken[s.request_id] if at < p.index]
                keep = [x for x in range(s.start, s.start + s.count) if not any(lo <= x < hi for lo, hi in spans)]
                if not keep:
                    continue
                if keep != list(range(keep[0], keep[-1] + 1)):
                    raise ValueError(f"relayout of {s.request_id!r} leaves step {p.index} a split slice")
                cut = keep[0] - s.start
                s = replace(s, start=keep[0], count=len(keep), tokens=s.tokens[cut: cut + len(keep)],
                            logit_rows=tuple(lr - cut for lr in s.logit_rows if 0 <= lr - cut < len(keep)))
            slices.append(replace(s, row_offset=row))
            row += s.count
        if slices:
            out.append(replace(p, slices=tuple(slices)))
    sites = [replace(x, step=moved[(x.request_id, x.position)]) if (x.request_id, x.position) in moved else x
             for x in sites]
    forced = {k: (SOLO if isinstance(v, RelayoutStep) else v) for k, v in forced.items()}
    return out, sites, forced
