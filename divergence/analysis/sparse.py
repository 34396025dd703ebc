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

from ..core.events import StepPlan
from ..core.names import WARM

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

    def plans(self, plans: list[StepPlan]) -> list[StepPlan]:
        return [p for p in plans if self.first <= p.index <= self.last]

    def words(self) -> str:
        return f"sparse replay: steps {self.first}-{self.last} ({self.steps} of {self.of})"


def first_steps(plans: list[StepPlan]) -> dict[str, int]:
    """request -> the first step (either model's) that computes it."""
    out: dict[str, int] = {}
    for p in plans:
        for s in p.slices:
            out.setdefault(s.request_id, p.index)
    return out


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


def plan_window(trace, plans: list[StepPlan], focus, until: int | None, forced_steps=()) -> SparseWindow | str:
    """The window that gives `focus`'s bits up to step `until` (None: the last step), or
    the reason a sparse replay is not known to be faithful for this trace (run it in full)."""
    if trace.tp_degree > 1:
        return TP
    if trace.has_routing:
        return MOE
    settings = trace.meta.get("settings", {})
    firsts = first_steps(plans)
    readers = prefix_readers(trace.requests, settings, trace.meta.get("schedule", ""))
    real, todo = set(), [r for r in focus if r in firsts]
    while todo:  # the focus, and everyone whose K/V they (or those) may read, before them
        r = todo.pop()
        if r in real:
            continue
        real.add(r)
        todo += [q for q in readers.get(r, ()) if q in firsts and firsts[q] <= firsts[r] and q not in real]
    last_index = plans[-1].index if plans else 0
    last = last_index if until is None else min(int(until), last_index)
    starts = [firsts[r] for r in real] + [int(s) for s in forced_steps]
    first = min(starts, default=0)
    window = [p for p in plans if first <= p.index <= last]
    stand_ins = {s.request_id for p in window for s in p.slices} - real
    return SparseWindow(first, last, frozenset(real), frozenset(stand_ins), len(window), len(plans))
