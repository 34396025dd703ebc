"""Is a re-run a re-run of B with only the forced change? What a confirmation must check
before it trusts the re-run's tokens (this engine's replay, or the user's --confirm-cmd).

A re-run counts only if (1) its steps before the forced one have B's composition, kernel
labels and K/V hashes, (2) its schedule is B's, and (3) the forced step differs from B's
exactly as asked: its requests split out (each in its own forward pass, in one step or in
consecutive steps), or the kernels asked for recorded at that step. (4), the re-run then
matching A up to the divergence, is the confirmer's own check. `check_rerun` says which
holds, the first difference where one does not, and what the re-run did at the forced
step, in words read from its records (not from the command line). Engine-free.

What may be asked: analysis.rerun_asks; the runs compared: analysis.run_view."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..core.labels import composition_text, label_policy
from ..core.names import ATTENTION, EXPERTS, GATE
from .rerun_asks import AnyChange, Kernels, Relayout, Split, Unchecked
from .run_view import RunView, view


@dataclass
class RerunCheck:
    valid: bool
    first_difference: str | None
    did: str  # what the re-run did at the forced step (from its records), '' when not valid

    def __bool__(self) -> bool:
        return self.valid


def _keys(plan) -> tuple:
    return tuple((s.request_id, s.phase, s.start, s.count) for s in plan.slices)


def _comp(plan) -> str:
    return composition_text(plan.slices) if plan is not None else "nothing"


def _passes(view: RunView, step: int) -> list[int]:
    """Rows of each forward pass of a step: the records of its first linear op at its first
    layer (a step this engine ran request by request records each pass)."""
    ks = [k for k in view.kernels(step) if k[2] not in (ATTENTION, EXPERTS, GATE)]
    if not ks:
        return []
    first = min(ks, key=lambda k: k[1])
    model, layer, op = first[0], first[1], first[2]
    return [k[4] for k in ks if (k[0], k[1], k[2]) == (model, layer, op)]


def _labels(view: RunView, step: int) -> dict:
    """op -> the labels the step recorded for it (every layer and expert), in order of ops."""
    out: dict = {}
    for _, _, op, _, _, label in view.kernels(step):
        out.setdefault(op, []).append(label)
    return out


def _first_kernel_difference(b: RunView, r: RunView, step: int) -> str | None:
    kb, kr = b.kernels(step), r.kernels(step)
    # only what B recorded can be compared: another engine's trace (BatchGenerator's) records
    # no kernels, a trace of an older schema no attention; this engine's re-run records them all
    recorded = {k[2] for k in kb}
    kr = [k for k in kr if k[2] in recorded]
    cb = Counter((m, l, o, e, lab) for m, l, o, e, _, lab in kb)
    cr = Counter((m, l, o, e, lab) for m, l, o, e, _, lab in kr)
    if cb == cr:
        return None
    order = {k[:4]: i for i, k in reversed(list(enumerate((m, l, o, e) for m, l, o, e, _, _ in kb + kr)))}
    keys = sorted({k[:4] for k in (cb - cr) + (cr - cb)}, key=lambda k: (k[1], order[k]))
    m, layer, op, e = keys[0]
    lb = sorted({k[4] for k in cb if k[:4] == (m, layer, op, e)})
    lr = sorted({k[4] for k in cr if k[:4] == (m, layer, op, e)})
    where = f"{op} at layer {layer}" + (f" (expert {e})" if e >= 0 else "")
    if not lr:
        return f"step {step} ran no {where}, B's ran {', '.join(lb)}"
    if not lb:
        return f"step {step} ran {where} on {', '.join(lr)}, which B's step did not run"
    return f"step {step} ran kernel {', '.join(lr)} for {where}, B's ran {', '.join(lb)}"


def _owned(v: RunView, cells: list) -> list:
    """The cells written by a request the step computed: a write recorded for a request that
    reads another's blocks (the prefix cache) mirrors the owner's, and how far that mirror
    reaches is not the step's computation (a relayout that later recomputes part of those
    blocks shortens it), while the owner's writes stay B's."""
    computed: dict = {}

    def of(step: int) -> set:
        if step not in computed:
            p = v.plans.get(step)
            computed[step] = {s.request_id for s in p.slices} if p is not None else set()
        return computed[step]

    return [c for c in cells if c[2] in of(c[0])]


def _first_kv_difference(b: RunView, r: RunView, before: int, window=None) -> str | None:
    since, only = (window.first, window.real) if window is not None else (0, None)
    cb, cr = b.kv_cells(before, since=since, only=only), r.kv_cells(before, since=since, only=only)
    if cb == cr:
        return None
    cb, cr = _owned(b, cb), _owned(r, cr)
    if cb == cr:
        return None
    sb, sr = set(cb), set(cr)
    first = min((sb - sr) | (sr - sb) or {min(cb + cr)})
    step, model, rid, layer, pos = first[:5]
    what = "draft's " if model != "target" else ""
    where = f"step {step}'s {what}K/V write of {rid} at layer {layer}, position {pos}"
    mine = {c[:5] for c in cr}
    theirs = {c[:5] for c in cb}
    if first[:5] not in mine:
        return f"{where} is missing (B wrote it)"
    if first[:5] not in theirs:
        return f"{where} is not in B"
    return f"{where} differs from B's (other K/V hashes)"


def check_rerun(b, rerun, forced_step: int, forced, *, window=None) -> RerunCheck:
    """b: B's Trace; rerun: the re-run's Trace or RunRecord; forced_step: B's first forced
    step; forced: what was asked there (Split, Kernels, Relayout, AnyChange, Unchecked), or a
    dict {step: that} of every forced step (this engine's replays keep B's step indices: each
    is checked). window: a sparse replay's (analysis/sparse.py): (1) holds on the steps it
    ran, and the K/V compared are those of the requests it gives exactly (its stand-ins'
    values are not B's by design). Returns RerunCheck(valid, first_difference, did)."""
    rv, bv = (rerun if isinstance(rerun, RunView) else RunView(rerun)), view(b)
    steps = forced if isinstance(forced, dict) else {forced_step: forced}
    first = min(steps) if steps else (forced_step if forced_step is not None else max(bv.plans, default=-1) + 1)

    def bad(why: str) -> RerunCheck:
        return RerunCheck(False, why, "")

    # (2) the schedule
    if rv.schedule != bv.schedule:
        return bad(f"its schedule is {rv.schedule}, B's is {bv.schedule}")
    # (1) the steps before the forced one: composition, kernels, K/V
    since = window.first if window is not None else 0
    before_b = [i for i in bv.plans if since <= i < first]
    before_r = [i for i in rv.plans if since <= i < first]
    for i in sorted(set(before_b) | set(before_r)):
        pb, pr = bv.plans.get(i), rv.plans.get(i)
        if pb is None or pr is None or pb.model != pr.model or _keys(pb) != _keys(pr):
            return bad(f"step {i}'s composition differs: B ran {_comp(pb)}, the re-run {_comp(pr)}")
        why = _first_kernel_difference(bv, rv, i)
        if why:
            return bad(why)
    if bv.has_kv:
        if not rv.has_kv:
            return bad("it records no K/V hashes, B's trace does: its cache cannot be checked")
        why = _first_kv_difference(bv, rv, first, window)
        if why:
            return bad(why)
    # (3) the forced steps, each as asked
    did = []
    for i, (step, asked) in enumerate(sorted(steps.items())):
        ok, words = _forced_as_asked(bv, rv, step, asked, compare_b=i == 0 or rv.is_trace)
        if not ok:
            return bad(words)
        did.append(words)
    return RerunCheck(True, None, "; ".join(w for w in did if w))


def _groups(bv: RunView, rv: RunView, step: int, compare_b: bool):
    """How the re-run computed B's step: (groups of slice keys, one forward pass each;
    how many steps of the re-run that took) or (None, why not)."""
    pb, pr = bv.plans.get(step), rv.plans.get(step)
    if pr is None:
        return None, f"the re-run has no step {step} (B's: {_comp(pb)})"
    want = _keys(pb) if (compare_b and pb is not None) else _keys(pr)
    if _keys(pr) == want:
        passes = _passes(rv, step)
        if len(want) > 1 and passes == [k[3] for k in want]:
            return [[k] for k in want], 1
        return [list(want)], 1
    left, groups, i = list(want), [], step
    while left:  # B's step run in several steps of the re-run (its later steps renumbered)
        p = rv.plans.get(i)
        keys = _keys(p) if p is not None else ()
        if not keys or any(k not in left for k in keys) or (p.model != pb.model if pb is not None else False):
            return None, f"step {step}'s composition differs: B ran {_comp(pb)}, the re-run {_comp(pr)}"
        groups.append(list(keys))
        left = [k for k in left if k not in keys]
        i += 1
    return groups, i - step


def _alone(groups, who) -> list[str]:
    """Requests of `who` (None: all) that still share a forward pass with another request."""
    out = []
    for g in groups:
        ids = {k[0] for k in g}
        if len(ids) > 1:
            out += [k[0] for k in g if who is None or k[0] in who]
    return out


def _split_words(step: int, groups, asked_requests) -> str:
    ids = [g[0][0] for g in groups if len({k[0] for k in g}) == 1]
    n = len(groups)
    if all(len(g) == 1 for g in groups):
        return f"step {step} split: {', '.join(ids)} each in its own forward pass"
    alone = [i for i in ids if asked_requests is None or i in asked_requests]
    return f"{', '.join(alone)} split out of step {step} ({n} forward passes)"


def _forced_as_asked(bv: RunView, rv: RunView, step: int, asked, *, compare_b: bool) -> tuple[bool, str]:
    if isinstance(asked, Unchecked):
        return True, asked.words
    groups, n = _groups(bv, rv, step, compare_b)
    if groups is None:
        if isinstance(asked, Relayout):
            pr = rv.plans.get(step)
            sl = next((s for s in (pr.slices if pr is not None else ()) if s.request_id == asked.request), None)
            if sl is None or sl.start != asked.start:
                return False, (f"step {step} did not compute {asked.request}'s positions from {asked.start} in one "
                               f"pass, as asked (it ran {_comp(pr)})")
            if len(pr.slices) > 1 and _passes(rv, step) != [s.count for s in pr.slices]:
                return False, f"step {step}'s requests still share a forward pass: the forcing was not applied"
            return True, f"step {step} run request by request, {asked.request} from position {asked.start} in one pass"
        return False, n
    split = len(groups) > 1
    pb = bv.plans.get(step)
    comp = _comp(pb)
    if isinstance(asked, Relayout):
        asked = Split(None)
    if isinstance(asked, Split):
        if not split and len(groups[0]) > 1:
            return False, f"step {step} ran {comp} in one forward pass, as B did: the forcing was not applied"
        shared = _alone(groups, asked.requests)
        if shared:
            return False, f"step {step}'s {shared[0]} still shares a forward pass with other requests"
        return True, _split_words(step, groups, asked.requests)
    if split:
        if isinstance(asked, AnyChange) or (isinstance(asked, Kernels) and asked.or_split):
            return True, _split_words(step, groups, None)
        return False, f"step {step} was split into {len(groups)} forward passes, not run on the kernels asked"
    lb, lr = _labels(bv, step), _labels(rv, step)
    if isinstance(asked, AnyChange):
        changed = [o for o in lr if lr[o] != lb.get(o)]
        if not changed:
            return False, (f"step {step} ran {comp} in one forward pass on B's kernels: the command changed "
                           f"nothing there")
        return True, _kernel_words(step, changed, lb, lr)
    asked_labels = set(asked.ops.values())
    for op, want in asked.ops.items():
        got = lr.get(op)
        if not got:
            return False, f"step {step} ran no {op} (B's ran {', '.join(sorted(set(lb.get(op, []))))})"
        if any(not _same_kernel(g, want) for g in got):
            shown = ", ".join(sorted(set(got)))
            if got == lb.get(op):
                return False, f"step {step} ran kernel {shown} for {op}, as B did: the forcing was not applied"
            return False, f"step {step} ran kernel {shown} for {op}, not {want} as asked"
    for op, got in lr.items():
        if op in asked.ops or got == lb.get(op) or (asked.others and set(got) <= asked_labels):
            continue
        if lb and op not in lb:  # an op B's trace does not record (an older schema's attention)
            continue
        return False, (f"step {step} ran kernel {', '.join(sorted(set(got)))} for {op}, B's "
                       f"{', '.join(sorted(set(lb.get(op, [])))) or 'nothing'}, and that was not asked")
    changed = [o for o in lr if lr[o] != lb.get(o)]
    return True, _kernel_words(step, changed, lb, lr)


def _same_kernel(got: str, want: str) -> bool:
    """A recorded label is the one asked ('gemm' asks for gemm at any split-K count)."""
    return label_policy(got) == label_policy(want) or (want == "gemm" and got.partition("/")[0] == "gemm")


def _kernel_words(step: int, changed, lb: dict, lr: dict) -> str:
    """'step 3 run on kernel mv where B ran mm/4 (attn.q, attn.k)'."""
    if not changed:
        return f"step {step} run on the kernels asked (they are B's own)"
    pairs: dict = {}
    for op in changed:
        pairs.setdefault((", ".join(sorted(set(lr[op]))), ", ".join(sorted(set(lb.get(op, []))))), []).append(op)
    parts = [f"kernel {new} where B ran {old or 'nothing'} ({', '.join(ops)})" for (new, old), ops in pairs.items()]
    return f"step {step} run on " + "; ".join(parts)


