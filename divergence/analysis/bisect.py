"""Walk back from a divergent token to the batch step that caused it.

1. At the divergent step (the one that computed the flipped token; with no flip,
   the first differing logits), compare the KV writes it actually read (the live
   write of every (layer, position), rollbacks and overwrites included).
2. The earliest differing (position, layer) names the write, and so the step,
   in each trace; those steps' rows, composition and kernels are the lead.
3. Classify: `sampler` (the logits are bitwise equal up to and at the flip, and
   the draws show the sampler's own inputs moved: the draft's q in speculative
   sampling; the lead is then the draft step that computed q, or the draft step
   whose K/V it read differently), `step_compute` (the cache the step read was
   identical: its own kernels differ), `cache_contamination` (an earlier write
   differs). A plain sample whose same u fell on another token means logits
   outside the stored top-k differ: a compute cause.
Replay (`confirm`) turns the lead into proof.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..core.names import MODELS
from .cause import CACHE_CONTAMINATION, ENVIRONMENT, SAMPLER, STEP_COMPUTE, BisectReport, ReplayBisection, RootCause
from .confirmation import Confirmation, Confirmer
from .ops import FirstOp
from .diff import DIVERGED, DiffReport, RequestDiff, diff_traces
from .environment import environment_differs
from .replay_progress import replay_label
from .routing import find_routing_flip
from .sampler import sampler_story
from .step_view import WRITE_OPS, step_view, step_views
from .tp import describe as tp_describe


def _lead_without_hashes(a, b, rd: RequestDiff, d: DiffReport) -> str:
    """No KV hashes to walk back through and no replay here (another engine's traces): the
    step whose logits first differ is the lead, said to be only that, with the command that
    would confirm it through the engine that made the traces."""
    site = rd.first_numeric_divergence or rd.first_divergent_token
    if site is None:
        return "not found: the traces have no KV hashes and nothing differs numerically"
    comp = step_view(b, site.step_b)
    rows = ", ".join(f"{c['request_id']} {c['phase']}[{c['start']}:{c['start'] + c['count']}]" for c in comp.composition)
    return (f"not found (no KV hashes to walk back through, and no replay of these traces here); lead only: "
            f"the logits first differ at position {site.position}, computed in {d.label_b} step {site.step_b} "
            f"({comp.rows} rows = {rows}) and {d.label_a} step {site.step_a}; to confirm it, re-run B with that "
            f"step changed: divergence bisect {d.path_a} {d.path_b} --confirm-cmd CMD")


def as_environment_cause(a, b, cause: RootCause) -> RootCause:
    """Two runs of one schedule in different numeric environments: where the lead is the same
    step, with the same composition in both, what changed its bits is the environment (the
    BLAS, its core, the device), not the batch. The cause, said so with the fields; else the
    cause as it was."""
    env = environment_differs(a, b)
    if not env or cause.kind == SAMPLER or a.meta.get("schedule") != b.meta.get("schedule"):
        return cause
    if cause.a.step == cause.b.step and cause.a.composition == cause.b.composition:
        return replace(cause, kind=ENVIRONMENT, env_diff=env)
    return cause


def complete_cause(a, b, rd: RequestDiff, lead: RootCause) -> RootCause:
    """The lead with what the pair adds to it: the routing flip on its path (MoE), what
    tensor parallelism did at its step, and its kind once the environments are weighed."""
    return as_environment_cause(a, b, replace(lead, routing_flip=_routing_flip(a, b, rd),
                                              tensor_parallel=tp_describe(a, b, lead)))


def find_root_cause(a, b, d: RequestDiff) -> RootCause | None:
    """The lead for one diverged request, from KV hashes (and, for sampled requests, draws) alone."""
    num = d.first_numeric_divergence
    tok = d.first_divergent_token
    if num is None and tok is None:
        return None
    story = sampler_story(a, b, d.id, tok.position, tok.step_a, tok.step_b, _label(a, "A"), _label(b, "B")) \
        if tok is not None else None
    if tok is not None and (num is None or num.position > tok.position):
        # The stored logits are bitwise equal up to and at the flip. Where the draws show the
        # same u falling elsewhere in a plain sample, the logits outside the top-k differ: a
        # compute cause like any other (below). Otherwise the sampler decided it.
        if story is None or story.depends_on_draft or story.uniform_differs:
            return _sampler_cause(a, b, d, tok, story)
    # The divergent step is the one that computed the flipped token (or, with no flip,
    # the first differing logits); compare every KV write it read.
    if tok is not None:
        pos, step_a_div, step_b_div = tok.position, tok.step_a, tok.step_b
    else:
        pos, step_a_div, step_b_div = num.position, num.step_a, num.step_b
    until = tok.step_b if tok is not None else num.step_b
    lead = _kv_lead(a, b, d.id, pos, step_a_div, step_b_div, "target")
    if lead is None:
        # The cache it read was identical: this step's own kernels (often lm_head) made the difference.
        va, vb, op = step_views(a, b, step_a_div, step_b_div, prefer=("lm_head",) + WRITE_OPS)
        return RootCause(STEP_COMPUTE, None, [pos - 1], va, vb, co_batched(b, step_b_div, d.id), op=op,
                         sampler=story)
    layer, positions, step_a, step_b = lead
    kind = STEP_COMPUTE if step_b == step_b_div and step_a == step_a_div else CACHE_CONTAMINATION
    va, vb, op = step_views(a, b, step_a, step_b)
    co = co_batched(b, step_b, d.id)
    return RootCause(kind, layer, positions, va, vb, co, finished_before(b, co, until), op=op, sampler=story)


def _kv_lead(a, b, rid: str, pos: int, step_a: int, step_b: int, model: str):
    """The earliest (position, layer) whose live K/V, as read by the row predicting `pos`
    at those steps, differ: (layer, B positions that B step wrote at that layer, A step,
    B step); None when everything read was identical."""
    ka = _cells(a.live_kv(rid, model=model, at_step=step_a), pos)
    kb = _cells(b.live_kv(rid, model=model, at_step=step_b), pos)
    # Both key arrays are sorted and unique: intersect by binary search (np.intersect1d
    # hashes, far slower on a million cells).
    ib_all = np.searchsorted(kb["key"], ka["key"])
    hit = ib_all < len(kb["key"])
    hit[hit] = kb["key"][ib_all[hit]] == ka["key"][hit]
    ia, ib = np.flatnonzero(hit), ib_all[hit]
    differ = (ka["k"][ia] != kb["k"][ib]) | (ka["v"][ia] != kb["v"][ib])
    if not differ.any():
        return None
    # common is sorted by (position, layer): the first differing cell is the earliest.
    ja, jb = ia[differ][0], ib[differ][0]
    layer = int(kb["layer"][jb])
    wa, wb = int(ka["step"][ja]), int(kb["step"][jb])
    # All differing positions written by that same B step at that layer.
    sel = (kb["step"][ib[differ]] == wb) & (kb["layer"][ib[differ]] == layer)
    return layer, sorted(int(p) for p in kb["position"][ib[differ]][sel]), wa, wb


def _sampler_cause(a, b, d: RequestDiff, tok, story) -> RootCause:
    """Equal target logits, another token. Where the draw involved the draft (accept test,
    residual, proposal), the draft's q differed: the lead is the draft step that computed
    it, or the earlier draft step whose K/V it read differently."""
    if story is None or not story.depends_on_draft:
        va, vb, _ = step_views(a, b, tok.step_a, tok.step_b)
        return RootCause(SAMPLER, None, [tok.position], va, vb, co_batched(b, tok.step_b, d.id), op=None,
                         sampler=story)
    da, db = draft_step(a, d.id, tok.position, tok.step_a), draft_step(b, d.id, tok.position, tok.step_b)
    if da is None or db is None:
        va, vb, _ = step_views(a, b, tok.step_a, tok.step_b)
        return RootCause(SAMPLER, None, [tok.position], va, vb, co_batched(b, tok.step_b, d.id), op=None,
                         sampler=story)
    lead = _kv_lead(a, b, d.id, tok.position, da, db, "draft")
    layer, positions, step_a, step_b = lead if lead is not None else (None, [tok.position - 1], da, db)
    va, vb, op = step_views(a, b, step_a, step_b, prefer=("lm_head",) + WRITE_OPS if lead is None else WRITE_OPS)
    co = co_batched(b, step_b, d.id)
    return RootCause(SAMPLER, layer, positions, va, vb, co, finished_before(b, co, tok.step_b), op=op,
                     sampler=story, model="draft")


def draft_step(trace, rid: str, position: int, before: int) -> int | None:
    """The latest draft step before `before` that predicted `position` for the request
    (its slice's last row is position - 1): where the q of that position's draws came from."""
    st = trace.steps
    idx = np.asarray(st["index"])
    models = np.asarray(st["model"])
    draft_code = _model_code(trace, "draft")
    for i in np.flatnonzero((idx < before) & (models == draft_code))[::-1]:
        for s in trace.step_plan(int(idx[i])).slices:
            if s.request_id == rid and s.start + s.count == position:
                return int(idx[i])
    return None


def _model_code(trace, name: str) -> int:
    return MODELS.index(name)


def _label(trace, default: str) -> str:
    return str(trace.meta.get("schedule", default))


def _cells(live, pos: int) -> dict:
    """Live writes for positions < pos (what the row at pos - 1 read), keyed (position, layer)."""
    position = np.asarray(live["position"])
    keep = position < pos
    layer = np.asarray(live["layer"])[keep]
    position = position[keep]
    key = position.astype(np.int64) * 4096 + layer
    order = np.argsort(key, kind="stable")
    return {"key": key[order], "layer": layer[order], "position": position[order],
            "step": np.asarray(live["step"])[keep][order],
            "k": np.asarray(live["k_hash"])[keep][order], "v": np.asarray(live["v_hash"])[keep][order]}


def co_batched(trace, step: int, rid: str) -> list[str]:
    """The other requests of one step."""
    return sorted({s.request_id for s in trace.step_plan(step).slices} - {rid})


def finish_step(trace, rid: str) -> int | None:
    """The step a request finished at (its last token's step in traces without the event)."""
    fs = trace.finish_step(rid)
    if fs is None:
        t = trace.tokens(rid)
        fs = int(t.steps[-1]) if len(t.steps) else None
    return fs


def finished_before(trace, ids, until: int) -> dict[str, int]:
    """id -> finish step, for the requests of `ids` that had finished before step `until`:
    the contaminating request can be long gone when the text flips."""
    return {rid: fs for rid in ids if (fs := finish_step(trace, rid)) is not None and fs < until}


def _routing_flip(a, b, rd: RequestDiff):
    """The earliest routing flip among the rows the divergent step read (MoE traces)."""
    tok, num = rd.first_divergent_token, rd.first_numeric_divergence
    site = tok if tok is not None else num
    return find_routing_flip(a, b, rd.id, position=site.position, step_a=site.step_a, step_b=site.step_b)


def bisect_traces(a, b, *, confirm: bool = False, confirmer: Confirmer | None = None, replay_bisector=None,
                  bitwise: bool = False, op_finder=None, only=None) -> BisectReport:
    """a, b: open Traces. With confirm, `confirmer` (analysis.confirmation.Confirmer) proves
    each cause by a re-run; it is prepared with every (cause, request diff) first, so that
    requests forced alike share one replay.
    Traces without KV hashes need `replay_bisector(request_diff)` -> ReplayBisection (or the
    tuple of its fields): a binary search over steps by replay
    (analysis.confirm.make_replay_bisector), whose replays confirm the cause it finds;
    why_not_found goes to BisectReport.unexplained.
    bitwise: requests whose tokens match but whose logits differ are diverged and get causes.
    op_finder(cause, request_diff) -> (OpDifference | None, detail): replays both root
    steps recording every op's output rows (analysis.replayer.make_op_finder)."""
    d = diff_traces(a, b, bitwise=bitwise)
    causes: dict[str, RootCause] = {}
    confirmations: dict[str, Confirmation] = {}
    unexplained: dict[str, str] = {}
    hashed = a.has_kv_hashes and b.has_kv_hashes
    mode = "kv-hashes"
    replays = 0
    diffs = {rd.id: rd for rd in d.requests}
    for rd in d.requests:
        if rd.status != DIVERGED or (rd.first_divergent_token is None and rd.first_numeric_divergence is None):
            continue
        if only is not None and rd.id not in only:
            continue
        if hashed:
            cause = find_root_cause(a, b, rd)
        elif replay_bisector is not None:
            got = replay_bisector(rd)
            if not isinstance(got, ReplayBisection):
                got = ReplayBisection(*got)
            cause = got.cause
            replays += got.replays
            if cause is None and got.why_not_found:
                unexplained[rd.id] = got.why_not_found
            if cause is not None and got.confirmation is not None:
                confirmations[rd.id] = got.confirmation
        else:
            cause = None
            unexplained[rd.id] = _lead_without_hashes(a, b, rd, d)
        if cause is not None:
            causes[rd.id] = complete_cause(a, b, rd, cause)
    if not hashed:
        mode = (f"replay bisection: the traces have no KV hashes, so steps were bisected by replay "
                f"({replays} replays)") if replay_bisector is not None else "none: no KV hashes and no replay"
    if confirm and confirmer is not None and hashed:
        confirmer.prepare([(cause, diffs[rid]) for rid, cause in causes.items()])
        for k, (rid, cause) in enumerate(causes.items(), 1):
            with replay_label(f"confirming {rid} ({k}/{len(causes)}):"):  # (a progress line on a terminal)
                confirmations[rid] = confirmer.confirm(cause, diffs[rid])
    first_ops = {rid: FirstOp(*op_finder(cause, diffs[rid])) for rid, cause in causes.items()} \
        if op_finder is not None and hashed else {}
    return BisectReport(d, causes, mode, confirm or not hashed, unexplained, confirmations, first_ops)
