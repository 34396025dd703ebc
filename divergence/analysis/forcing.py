"""How to make B's step compute what A's did, for a confirming replay: run its ops on
A's kernels, each request alone (SOLO), or A's very span of positions in one pass
(RelayoutStep); and which request's slice computed a cause's positions (a prefix-cache
hit reads blocks another request wrote). Engine-free: it reads traces only."""
from __future__ import annotations

import numpy as np

from ..core.labels import label_policy
from ..core.names import ATTENTION, EXPERTS, PREFILL
from ..core.policy import SOLO, KernelPolicy, RelayoutStep, SoloStep
from .step_view import step_kernels


def _as_a(a_step_kernels: dict, a_rows: dict | None = None) -> dict:
    """Force a B step to run every op with the kernel A's step used for it. A `native`
    op that A ran on one row is forced to `gemv` (the native op one row at a time): on
    a backend whose native kernel depends on the row count, that is A's kernel."""
    out = {}
    for op, lbl in a_step_kernels.items():
        if lbl == "native" and a_rows is not None and a_rows.get(op) == 1:
            lbl = "gemv"
        out[op] = KernelPolicy.parse(label_policy(lbl))
    return out


def force_like_a(a, step_a: int, b, step_b: int, rid: str | None = None, positions=None, layer=None, *,
                 alone: bool = False):
    """How to make B's step compute what A's did. Where the kernel labels differ (the
    engine's own kernels), run each op on A's kernel. Where they are the same (`native`
    on both sides: a real backend whose kernels we do not choose), the difference is
    the batch itself, so run each request of the step alone (SOLO), as A's did; and so
    where A's experts ran on several kernels (one per expert's row count). Attention is
    left out of the comparison: a step alone runs it per sequence, as A's did. Where,
    besides, A's step computed the request's positions as another span (a prefill that
    B split by the prefix cache or by chunking), B's step computes A's span in one pass
    (RelayoutStep): on a backend whose kernels depend on the row count, only A's rows do.
    alone: run the step as A ran it (SOLO / RelayoutStep) whatever the kernel labels."""
    ka = step_kernels(a, step_a)
    kb = step_kernels(b, step_b)
    # the ops both steps ran (a step without logit rows has no lm_head: a prefill chunk in
    # A, the same chunk beside decode rows in B), compared by kernel label
    shared = (ka.keys() & kb.keys()) - {ATTENTION}
    same = all(ka[o] == kb[o] for o in shared)
    if same or alone or _mixed_experts(a, step_a):
        if rid is not None and a.step_plan(step_a).model == b.step_plan(step_b).model:
            oa, ob = owner_of(a, step_a, rid, positions, layer), owner_of(b, step_b, rid, positions, layer)
            sa, sb = _slice_of(a, step_a, oa), _slice_of(b, step_b, ob)
            # a span that starts later than B's would need B's earlier positions from a cache it
            # never had: only spans that start as early or earlier (recomputing) are forced
            if sa is not None and sb is not None and (sa.start, sa.count) != (sb.start, sb.count) \
                    and sa.start <= sb.start and sa.start + sa.count <= _known_len(b, ob):
                return RelayoutStep(ob, sa.start, sa.start + sa.count)
        return SOLO
    return _as_a(ka, rows_per_op(a, step_a))


def prefill_as_a(a, b, rid: str, until_b: int) -> dict:
    """B step -> RelayoutStep: the request's prompt computed in A's prefill passes, each pass
    in one B step (before `until_b`), every position as A computed it, each step alone.

    Where the chunk boundaries themselves differ (a chunked prefill that shared its token
    budget with other requests' rows in B, and not in A), no single step's forcing
    reproduces A's rows: B's chunks straddle A's. Pass k goes to B's k-th prefill step of
    the request. Where B read the prompt's first blocks from the prefix cache (another
    request, or `warm`'s warm-up copy, computed them) and A computed them itself, the
    passes below that hit go to that owner's prefill steps, and the rest to the request's
    own, the first of them recomputing from its pass's start. Where B took fewer steps than
    A's passes (the owner's, or the request's own), the last of them runs the remaining
    passes one after the other.
    {} where that does not fit: the same passes, several owners, A's passes not starting at
    0 or at B's first position."""
    def spans(trace, who, until=None):
        return [(p.index, s.start, s.start + s.count) for p in trace.iter_plans()
                if p.model == "target" and (until is None or p.index < until)
                for s in p.slices if s.request_id == who and s.phase == PREFILL]

    sa, own = spans(a, rid), spans(b, rid, until_b)
    if not sa or not own or [x[1:] for x in sa] == [x[1:] for x in own] \
            or any(x[2] != y[1] for x, y in zip(sa, sa[1:])):
        return {}
    hit = own[0][1]  # B's first own position: the ones below it came from the prefix cache
    if sa[0][1] == hit:
        below, owner, owner_steps = [], None, []
    elif sa[0][1] == 0:
        owner = _prompt_owner(b, rid, hit, until_b)
        if owner is None:
            return {}
        below = [x for x in sa if x[2] <= hit]
        owner_steps = spans(b, owner, own[0][0])  # before the request read its blocks
    else:
        return {}
    if below and not owner_steps:
        return {}
    out = _passes(owner, owner_steps, below)
    out.update(_passes(rid, own, sa[len(below):]))
    return out


def _passes(rid: str, steps: list, passes: list) -> dict:
    """A's passes onto B's steps of the request, one a step; where B had fewer steps, its last
    one runs the remaining passes one after the other."""
    spans = [(lo, hi) for _, lo, hi in passes]
    k = min(len(steps), len(spans))
    out = {}
    for i, (step, _, _) in enumerate(steps[:k]):
        mine = spans[i:] if i == k - 1 else [spans[i]]
        out[step] = RelayoutStep(rid, *mine[0], then=tuple(mine[1:]))
    return out


def _prompt_owner(b, rid: str, hit: int, until_b: int) -> str | None:
    """The one request whose prefill wrote the blocks of `rid`'s first `hit` positions in B
    (a prefix-cache hit), or None (several, or none found)."""
    live = b.live_kv(rid, at_step=until_b - 1)
    sel = (live["layer"] == 0) & (live["position"] < hit)
    owners = set()
    for step in np.unique(live["step"][sel]).tolist():
        positions = live["position"][sel & (live["step"] == step)].tolist()
        owners.add(owner_of(b, int(step), rid, positions, 0))
    return owners.pop() if len(owners) == 1 and None not in owners and rid not in owners else None


def _known_len(trace, rid: str) -> int:
    """Positions whose input tokens the trace knows for a request: prompt and generated tokens."""
    req = next(r for r in trace.requests if r.id == rid)
    return len(req.prompt_tokens) + len(trace.tokens(rid).tokens)


def _slice_of(trace, step: int, rid: str | None):
    if rid is None:
        return None
    return next((s for s in trace.step_plan(step).slices if s.request_id == rid), None)


def _mixed_experts(trace, step: int) -> bool:
    """Did A's step run its experts on more than one kernel (threshold:N picks per expert
    from the rows it received)? No single kernel then reproduces it: SOLO does."""
    ks = trace.kernels(step=step)
    sel = ks["op"] == EXPERTS
    return len({(str(k), int(s)) for k, s in zip(ks["kernel"][sel], ks["splits"][sel])}) > 1


def forcing_words(forced: dict, label_a: str) -> str:
    steps = sorted(forced)
    shown = ", ".join(map(str, steps[:6])) + (f" and {len(steps) - 6} more" if len(steps) > 6 else "")
    solo = [s for s in steps if isinstance(forced[s], (SoloStep, RelayoutStep))]
    noun = "step" if len(steps) == 1 else "steps"
    spans = [forced[s] for s in steps if isinstance(forced[s], RelayoutStep)]
    span = ""
    if spans:
        r = spans[0]
        more = f" (and {len(spans) - 1} more spans)" if len(spans) > 1 else ""
        span = f", {r.request_id}'s positions {r.start}-{r.end - 1} computed in one pass as {label_a} did{more}"
    if len(solo) == len(steps):
        return f"{noun} {shown} run request by request (each request alone, as in {label_a}){span}"
    if not solo:
        return f"{noun} {shown} run on {label_a}'s kernels"
    return (f"{noun} {shown} run as in {label_a} ({len(solo)} request by request, the rest on {label_a}'s "
            f"kernels){span}")


def rows_per_op(trace, step: int) -> dict:
    ks = trace.kernels(step=step)
    out: dict = {}
    for op, rows in zip(ks["op"], ks["rows"]):
        out.setdefault(str(op), int(rows))
    return out


def owner_of(trace, step: int, rid: str, positions, layer: int | None = None) -> str | None:
    """The request whose slice in `step` computed the cause's positions: the request itself,
    or (a prefix-cache hit) the request whose blocks it shares: the one whose write at that
    step holds the very bytes the request read."""
    slices = trace.step_plan(step).slices
    if any(s.request_id == rid for s in slices):
        return rid
    if not positions:
        return None
    p0, layer = positions[0], layer or 0
    cover = [s.request_id for s in slices if s.start <= p0 < s.start + s.count]
    if len(cover) <= 1:
        return cover[0] if cover else None
    check = list(positions)[:64]
    want = [_cell(trace, rid, layer, p, None) for p in check]
    for other in cover:  # slice order is registration order: the first match owns the shared blocks
        if all(w is not None and _cell(trace, other, layer, p, step) == w for p, w in zip(check, want)):
            return other
    return cover[0]


def _cell(trace, rid: str, layer: int, position: int, at_step) -> tuple | None:
    cells = _CELLS.get((id(trace), rid, at_step))
    if cells is None:
        live = trace.live_kv(rid, at_step=at_step)
        cells = {(int(l), int(p)): (int(k), int(v))
                 for l, p, k, v in zip(live["layer"], live["position"], live["k_hash"], live["v_hash"])}
        if len(_CELLS) > 64:
            _CELLS.clear()
        _CELLS[(id(trace), rid, at_step)] = cells
    return cells.get((layer, position))


_CELLS: dict = {}  # (trace, request, step) -> {(layer, position): (k, v)}: owners are looked up cell by cell
