"""Is a re-run a re-run of B with only the forced change? What a confirmation must check
before it trusts the re-run's tokens (this engine's replay, or the user's --confirm-cmd).

A re-run counts only if (1) its steps before the forced one have B's composition, kernel
labels and K/V hashes, (2) its schedule is B's, and (3) the forced step differs from B's
exactly as asked: its requests split out (each in its own forward pass, in one step or in
consecutive steps), or the kernels asked for recorded at that step. (4), the re-run then
matching A up to the divergence, is the confirmer's own check. `check_rerun` says which
holds, the first difference where one does not, and what the re-run did at the forced
step, in words read from its records (not from the command line). Engine-free."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from ..core.events import Observer
from ..core.labels import composition_text, kernel_label, label_policy
from ..core.names import ATTENTION, EXPERTS, GATE


@dataclass(frozen=True)
class Split:
    """Asked: the step's requests split out. requests None: every request of the step alone."""

    requests: frozenset | None = None


@dataclass(frozen=True)
class Kernels:
    """Asked: these ops of the step on these kernel labels (op -> label, e.g. 'gemv', 'gemm/4').
    or_split: a re-run that split the step instead counts too (a user's engine, told A's
    kernel, may run the request alone to get it); others: the other ops may also run on an
    asked label (an engine that runs the whole step on it)."""

    ops: dict = field(default_factory=dict)
    or_split: bool = False
    others: bool = False


@dataclass(frozen=True)
class Relayout:
    """Asked (this engine's RelayoutStep): each request alone, and `request`'s slice covering
    its positions from `start` in one pass."""

    request: str
    start: int


@dataclass(frozen=True)
class AnyChange:
    """Asked: some change of the step, unnamed (a command that uses none of {force} {requests}):
    a split or other kernels both count."""


@dataclass(frozen=True)
class Unchecked:
    """A forcing this check does not read (tensor-parallel unsharding, a threshold policy)."""

    words: str = ""


@dataclass
class RerunCheck:
    valid: bool
    first_difference: str | None
    did: str  # what the re-run did at the forced step (from its records), '' when not valid

    def __bool__(self) -> bool:
        return self.valid


class RunRecord(Observer):
    """An in-memory record of a replay (its schedule, step plans, kernels and K/V writes),
    for check_rerun: pass it among a Replayer.run's observers."""

    wants_kernels = True

    def __init__(self, kv_hashes: bool = True):
        self.wants_kv_hashes = kv_hashes
        self.schedule = None
        self.plans: dict = {}
        self.kernel_rows: list = []  # (step, model, layer, op, expert, rows, label)
        self.kv: list = []

    def on_run_start(self, info) -> None:
        self.schedule = info.schedule

    def on_step(self, event) -> None:
        self.plans[event.plan.index] = event.plan

    def on_kernel(self, c) -> None:
        self.kernel_rows.append((c.step, c.model, c.layer, c.op, c.expert, c.rows, kernel_label(c.kernel, c.splits)))

    def on_kv_write(self, w) -> None:
        self.kv.append(w)


class _View:
    """The parts of a run check_rerun compares: of a Trace or of a RunRecord."""

    def __init__(self, run):
        self.run = run
        self.is_trace = not isinstance(run, RunRecord)
        if self.is_trace:
            self.schedule = run.meta.get("schedule")
            self.plans = {p.index: p for p in run.iter_plans()}
            self.has_kv = bool(run.has_kv_hashes)
            ks = run.kernels()
            labels = [kernel_label(str(k), int(s)) for k, s in zip(ks["kernel"], ks["splits"])]
            self._k = list(zip((int(x) for x in ks["step"]), (str(x) for x in ks["model"]),
                               (int(x) for x in ks["layer"]), (str(x) for x in ks["op"]),
                               (int(x) for x in ks["expert"]), (int(x) for x in ks["rows"]), labels))
        else:
            self.schedule, self.plans, self.has_kv, self._k = run.schedule, run.plans, run.wants_kv_hashes, \
                run.kernel_rows
        self._by_step: dict = {}
        for row in self._k:
            self._by_step.setdefault(row[0], []).append(row[1:])

    def kernels(self, step: int) -> list:
        """(model, layer, op, expert, rows, label) of the step, in recorded order."""
        return self._by_step.get(step, [])

    def kv_cells(self, before: int) -> list:
        """Sorted (step, model, request, layer, position, k, v) of every K/V write before `before`."""
        if not self.is_trace:
            out = []
            for w in self.run.kv:
                if w.step < before:
                    out += [(int(w.step), str(w.model), str(w.request_id), int(w.layer), int(w.start) + i, int(k),
                             int(v)) for i, (k, v) in enumerate(zip(w.k_hashes.tolist(), w.v_hashes.tolist()))]
            return sorted(out)
        t = self.run
        w, h = t.kv_writes(), t.kv_hashes()
        models, ids = t.codes("models"), [r.id for r in t.requests]
        sel = np.flatnonzero(np.asarray(w["step"]) < before)
        kh = np.asarray(h["k_hash"]).astype(np.uint64)
        vh = np.asarray(h["v_hash"]).astype(np.uint64)
        out = []
        for i in sel.tolist():
            off, n, start = int(w["hash_offset"][i]), int(w["count"][i]), int(w["start"][i])
            head = (int(w["step"][i]), models[int(w["model"][i])], ids[int(w["request"][i])], int(w["layer"][i]))
            out += [(*head, start + j, int(kh[off + j]), int(vh[off + j])) for j in range(n)]
        return sorted(out)


_VIEWS: list = []  # (trace, its view): B is checked against every re-run of one bisect


def view(run) -> _View:
    """What check_rerun reads of a Trace or RunRecord (a trace's view is kept for its next check)."""
    if isinstance(run, _View):
        return run
    if isinstance(run, RunRecord):
        return _View(run)
    for t, v in _VIEWS:
        if t is run:
            return v
    v = _View(run)
    _VIEWS.append((run, v))
    del _VIEWS[:-4]
    return v


def _keys(plan) -> tuple:
    return tuple((s.request_id, s.phase, s.start, s.count) for s in plan.slices)


def _comp(plan) -> str:
    return composition_text(plan.slices) if plan is not None else "nothing"


def _passes(view: _View, step: int) -> list[int]:
    """Rows of each forward pass of a step: the records of its first linear op at its first
    layer (a step this engine ran request by request records each pass)."""
    ks = [k for k in view.kernels(step) if k[2] not in (ATTENTION, EXPERTS, GATE)]
    if not ks:
        return []
    first = min(ks, key=lambda k: k[1])
    model, layer, op = first[0], first[1], first[2]
    return [k[4] for k in ks if (k[0], k[1], k[2]) == (model, layer, op)]


def _labels(view: _View, step: int) -> dict:
    """op -> the labels the step recorded for it (every layer and expert), in order of ops."""
    out: dict = {}
    for _, _, op, _, _, label in view.kernels(step):
        out.setdefault(op, []).append(label)
    return out


def _first_kernel_difference(b: _View, r: _View, step: int) -> str | None:
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


def _owned(v: _View, cells: list) -> list:
    """The cells written by a request the step computed: a write recorded for a request that
    reads another's blocks (the prefix cache) mirrors the owner's, and how far that mirror
    reaches is not the step's computation (a relayout that later recomputes part of those
    blocks shortens it), while the owner's writes stay B's."""
    computed = {i: {s.request_id for s in p.slices} for i, p in v.plans.items()}
    return [c for c in cells if c[2] in computed.get(c[0], ())]


def _first_kv_difference(b: _View, r: _View, before: int) -> str | None:
    cb, cr = b.kv_cells(before), r.kv_cells(before)
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


def check_rerun(b, rerun, forced_step: int, forced) -> RerunCheck:
    """b: B's Trace; rerun: the re-run's Trace or RunRecord; forced_step: B's first forced
    step; forced: what was asked there (Split, Kernels, Relayout, AnyChange, Unchecked), or a
    dict {step: that} of every forced step (this engine's replays keep B's step indices: each
    is checked). Returns RerunCheck(valid, first_difference, did)."""
    rv, bv = (rerun if isinstance(rerun, _View) else _View(rerun)), view(b)
    steps = forced if isinstance(forced, dict) else {forced_step: forced}
    first = min(steps) if steps else (forced_step if forced_step is not None else max(bv.plans, default=-1) + 1)

    def bad(why: str) -> RerunCheck:
        return RerunCheck(False, why, "")

    # (2) the schedule
    if rv.schedule != bv.schedule:
        return bad(f"its schedule is {rv.schedule}, B's is {bv.schedule}")
    # (1) the steps before the forced one: composition, kernels, K/V
    before_b = [i for i in bv.plans if i < first]
    before_r = [i for i in rv.plans if i < first]
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
        why = _first_kv_difference(bv, rv, first)
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


def _groups(bv: _View, rv: _View, step: int, compare_b: bool):
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


def _forced_as_asked(bv: _View, rv: _View, step: int, asked, *, compare_b: bool) -> tuple[bool, str]:
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


def asked_of_forcing(forced: dict) -> dict:
    """This engine's forcing ({step: SOLO | RelayoutStep | KernelPolicy | {op: KernelPolicy}})
    as what check_rerun checks at each step."""
    from ..core.policy import KernelPolicy, RelayoutStep, SoloStep

    out = {}
    for step, f in forced.items():
        if isinstance(f, RelayoutStep):
            out[step] = Relayout(f.request_id, f.start)
        elif isinstance(f, SoloStep):
            out[step] = Split(None)
        elif isinstance(f, dict) and all(isinstance(p, KernelPolicy) and p.threshold is None for p in f.values()):
            out[step] = Kernels({op: label_policy_to_label(p) for op, p in f.items()})
        else:
            out[step] = Unchecked("")
    return out


def label_policy_to_label(policy) -> str:
    """A forcible policy ('gemm:4') as the label its kernel records ('gemm/4')."""
    return str(policy).replace(":", "/", 1) if str(policy).startswith("gemm:") else str(policy)
