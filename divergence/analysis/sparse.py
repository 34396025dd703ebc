"""Which recorded steps a replay must run to give some requests' bits exactly (a sparse
replay), and which of those steps' rows are only stand-ins. Engine-free: the replayer
(analysis/replayer.py) hands the window to engine/replay.py.

Why this holds: a row's bits depend on the kernel that computes it (the step's shape, the
row's place in it, the attention layout), not on the other rows' values. So a replay that
proves a cause for request r re-executes only the steps from r's arrival to r's divergence,
with the other requests of those steps admitted at their recorded positions over K/V they
never computed (stand-ins: the recorded shape, not the recorded values). What r reads that
another request wrote (prefix-cache blocks, and the warm-up's copies) makes that writer
real too. tests/analysis/test_sparse_replay.py checks the claim on every kind of trace: the
sparse replay gives the full replay's tokens, top-k logits, K/V hashes and draws.

Where it is not known to hold, the window says why and the replay runs in full:
- MoE: the expert kernels group the rows by their routing, so a stand-in routed elsewhere
  changes the row counts r's experts run at;
- tensor parallel: every rank would have to agree on the window (not proved here).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.names import WARM
from .run_view import TracePlans

MOE = "MoE: the expert kernels group a step's rows by every row's routing, which stand-ins would not keep"
TP = "tensor parallel: a sparse replay across ranks is not proved faithful"


@dataclass(frozen=True)
class SparseWindow:
    """The recorded steps [first, last] a replay runs for `real` requests' bits; every other
    request in them is a stand-in (admitted at its recorded position, its values not kept)."""

    first: int
    last: int
    real: frozenset
    stand_ins: frozenset
    steps: int  # how many recorded steps that is
    of: int  # of how many the trace holds



def prefix_readers(requests, settings: dict, schedule: str) -> dict[str, set]:
    """request -> the requests whose K/V it may read through the prefix cache (any that
    shares at least one full block of its prompt); empty without a prefix cache."""
    if not (settings.get("prefix_caching") or schedule == WARM):
        return {}
    bs = int(settings.get("block_size") or 1)
    by_block: dict[tuple, set] = {}
    for r in requests:
        toks = tuple(r.prompt_tokens)
        if len(toks) >= bs:
            by_block.setdefault(toks[:bs], set()).add(r.id)
    out: dict[str, set] = {}
    for ids in by_block.values():
        if len(ids) > 1:
            for i in ids:
                out[i] = ids - {i}
    return out


def arrivals(trace, ids) -> dict[str, int]:
    """request -> the step it arrived at (its first step can come no earlier): from the
    request events, without reading any step plan; a request without one arrived at step 0."""
    return {r: trace.lifetime(r)[0] for r in ids}


def plan_window(trace, focus, until: int | None, forced_steps=(), plans_in=None) -> SparseWindow | str:
    """The window that gives `focus`'s bits up to step `until` (None: the last step), or
    the reason a sparse replay is not known to be faithful for this trace (run it in full).
    plans_in(first, last) -> the recorded plans of those steps (default: read from the trace);
    only the window's plans are read, so the cost follows the request, not the trace."""
    if trace.tp_degree > 1:
        return TP
    if trace.has_routing:
        return MOE
    settings = trace.meta.get("settings", {})
    known = {r.id for r in trace.requests}
    readers = prefix_readers(trace.requests, settings, trace.meta.get("schedule", ""))
    firsts = arrivals(trace, [r for r in focus if r in known])
    real, todo = set(), list(firsts)
    while todo:  # the focus, and everyone whose K/V they (or those) may read, before them
        r = todo.pop()
        if r in real:
            continue
        real.add(r)
        for q in readers.get(r, ()):
            if q not in real:
                firsts.setdefault(q, arrivals(trace, [q])[q])
                if firsts[q] <= firsts[r]:
                    todo.append(q)
    index = np.asarray(trace.steps["index"], np.int64)
    last_index = int(index.max()) if index.size else 0
    last = last_index if until is None else min(int(until), last_index)
    first = min([firsts[r] for r in real] + [int(s) for s in forced_steps], default=0)
    window = (plans_in or TracePlans(trace).between)(first, last)
    stand_ins = {s.request_id for p in window for s in p.slices} - real
    return SparseWindow(first, last, frozenset(real), frozenset(stand_ins), len(window), int(index.size))
