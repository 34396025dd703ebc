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

from dataclasses import dataclass, field

import numpy as np

from ..core.labels import kernel_label
from ..core.names import ATTENTION
from .diff import DIVERGED, DiffReport, RequestDiff, diff_traces
from .tp import describe as tp_describe
from .sampler import SamplerStory, sampler_story

CACHE_CONTAMINATION = "cache_contamination"
STEP_COMPUTE = "step_compute"
SAMPLER = "sampler"
ENVIRONMENT = "environment"  # the same step, laid out alike, computed under another BLAS / core / device
WRITE_OPS = ("k_proj", "v_proj")  # the ops whose output is written to the cache

# How a cause's confirmation was run (RootCause.confirmed_by): each confirmer sets one of
# these names; CONFIRMED_BY words them for the text report and the HTML page.
BY_REPLAY = "replay"  # this engine's replay of B, the step's ops on A's kernels
BY_REPLAY_SOLO = "replay_solo"  # ... the step run request by request, as A ran it
BY_REPLAY_PREFILL = "replay_prefill"  # ... the request's prompt computed in A's prefill passes
BY_REPLAY_UNSHARDED = "replay_unsharded"  # ... the TP side's sharded ops unsharded
BY_COMMAND = "command"  # the user's engine, re-run by --confirm-cmd
BY_ENVIRONMENT = "environment"  # B replayed under A's recorded environment
CONFIRMED_BY = {
    BY_REPLAY: "this engine's replay of B with the step's kernels forced to A's (--confirm)",
    BY_REPLAY_SOLO: "this engine's replay of B with the step run request by request (solo), as A ran it (--confirm)",
    BY_REPLAY_PREFILL: "this engine's replay of B with the request's prompt computed in A's prefill passes, "
                       "each request alone (--confirm)",
    BY_REPLAY_UNSHARDED: "this engine's replay of the TP side with its sharded ops unsharded (--confirm)",
    BY_COMMAND: "your engine, re-run by your command with the step changed (--confirm-cmd)",
    BY_ENVIRONMENT: "this engine's replay of B under A's recorded environment (--confirm)",
}


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


@dataclass
class RootCause:
    kind: str
    layer: int | None
    positions: list[int]  # positions of the earliest differing write (B side)
    a: StepView
    b: StepView
    co_batched_b: list[str]
    finished_before_divergence: dict = field(default_factory=dict)  # co-batched id -> finish step
    op: str | None = None  # the op whose kernel differs between the two steps
    confirmed: bool | None = None
    confirm_detail: str = ""
    # how the confirmation was run (a CONFIRMED_BY name), whatever its result; None: none ran
    confirmed_by: str | None = None
    routing_flip: object = None  # analysis.routing.RoutingFlip on the path to the divergence (MoE models)
    tensor_parallel: dict | None = None  # TP=1 vs TP=N pairs: see analysis.tp.describe
    sampler: SamplerStory | None = None  # where the flip's uniform draw fell in each trace
    model: str = "target"  # the model whose steps a and b are (draft: a sampler cause's q)
    first_op: object = None  # analysis.ops.OpDifference: the first op whose output rows differ (--ops / --confirm)
    first_op_detail: str = ""  # why there is none, when it was asked for
    env_diff: dict | None = None  # an environment cause: recorded field -> (A's, B's)

    @property
    def native_class_changes(self) -> dict[str, tuple[int, int]]:
        """op -> (rows in A, rows in B) for the natively run ops whose probed kernel class
        differs between the two steps: the backend computed those rows another way."""
        return native_class_changes(self.a, self.b)

    def to_json(self) -> dict:
        return {
            "kind": self.kind, "layer": self.layer, "positions": self.positions, "op": self.op,
            "step_a": self.a.step, "step_b": self.b.step, "rows_a": self.a.rows, "rows_b": self.b.rows,
            "kernel_a": self.a.kernel, "kernel_b": self.b.kernel, "co_batched_b": self.co_batched_b,
            "composition_a": self.a.composition, "composition_b": self.b.composition,
            "kernels_a": self.a.kernels, "kernels_b": self.b.kernels,
            "finished_before_divergence": self.finished_before_divergence,
            "native_class_changes": {op: {"rows_a": ra, "rows_b": rb}
                                     for op, (ra, rb) in self.native_class_changes.items()},
            "confirm_detail": self.confirm_detail,
            "confirmed_by": self.confirmed_by,
            "routing_flip": self.routing_flip.to_json() if self.routing_flip is not None else None,
            "tensor_parallel": self.tensor_parallel,
            "model": self.model,
            "first_op": self.first_op.to_json() if self.first_op is not None else None,
            "first_op_detail": self.first_op_detail,
            "sampler": self.sampler.to_json() if self.sampler else None,
            "env_diff": {k: list(v) for k, v in self.env_diff.items()} if self.env_diff else None,
        }


@dataclass
class ReplayBisection:
    """What a replay bisector (analysis.confirm.make_replay_bisector) found for one request:
    the cause (confirmed by its own replays) or None, the replays it ran, and why none was found."""

    cause: RootCause | None
    replays: int = 0
    why_not_found: str | None = None


@dataclass
class BisectReport:
    diff: DiffReport
    causes: dict[str, RootCause]  # request id -> root cause
    mode: str = "kv-hashes"  # or "replay" when the traces had no KV hashes
    confirm_requested: bool = False
    unexplained: dict[str, str] = field(default_factory=dict)  # request id -> why no cause was found

    @property
    def identical(self) -> bool:
        return self.diff.identical

    def groups(self) -> dict[tuple, list[str]]:
        """Requests that share one root-cause step (B side)."""
        out: dict[tuple, list[str]] = {}
        for rid, c in self.causes.items():
            out.setdefault((c.kind, c.b.step), []).append(rid)
        return out

    def to_json(self) -> dict:
        j = self.diff.to_json()
        j["mode"] = self.mode
        for r in j["requests"]:
            c = self.causes.get(r["id"])
            r["root_cause"] = c.to_json() if c else None
            if r["id"] in self.unexplained:
                r["root_cause_not_found"] = self.unexplained[r["id"]]
            r["confirmed"] = (c.confirmed if c else None) if self.confirm_requested else None
        j["groups"] = [{"kind": k[0], "step_b": k[1], "requests": v} for k, v in self.groups().items()]
        return j


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


def as_environment_cause(a, b, cause: RootCause) -> None:
    """Two runs of one schedule in different numeric environments: where the lead is the same
    step, with the same composition in both, what changed its bits is the environment (the
    BLAS, its core, the device), not the batch. The cause says so, with the fields."""
    from .environment import environment_differs

    env = environment_differs(a, b)
    if not env or cause.kind == SAMPLER or a.meta.get("schedule") != b.meta.get("schedule"):
        return
    if cause.a.step == cause.b.step and cause.a.composition == cause.b.composition:
        cause.kind, cause.env_diff = ENVIRONMENT, env


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
    # hashes, ~10x slower on a million cells).
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
    from ..core.names import MODELS

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
    from .routing import find_routing_flip

    tok, num = rd.first_divergent_token, rd.first_numeric_divergence
    site = tok if tok is not None else num
    return find_routing_flip(a, b, rd.id, position=site.position, step_a=site.step_a, step_b=site.step_b)


def bisect_traces(a, b, *, confirm: bool = False, replayer=None, replay_bisector=None,
                  bitwise: bool = False, op_finder=None) -> BisectReport:
    """a, b: open Traces. With confirm, `replayer(cause, request_diff)` -> (bool, detail)
    replays B with the root-cause step forced to A's kernels (see analysis.replayer).
    Traces without KV hashes need `replay_bisector(request_diff)` -> ReplayBisection (or the
    tuple of its fields): a binary search over steps by replay
    (analysis.replayer.make_replay_bisector); why_not_found goes to BisectReport.unexplained.
    bitwise: requests whose tokens match but whose logits differ are diverged and get causes.
    op_finder(cause, request_diff) -> (OpDifference | None, detail): replays both root
    steps recording every op's output rows (analysis.replayer.make_op_finder)."""
    d = diff_traces(a, b, bitwise=bitwise)
    causes: dict[str, RootCause] = {}
    unexplained: dict[str, str] = {}
    hashed = a.has_kv_hashes and b.has_kv_hashes
    mode = "kv-hashes"
    replays = 0
    for rd in d.requests:
        if rd.status != DIVERGED or (rd.first_divergent_token is None and rd.first_numeric_divergence is None):
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
        else:
            cause = None
            unexplained[rd.id] = _lead_without_hashes(a, b, rd, d)
        if cause is not None:
            cause.routing_flip = _routing_flip(a, b, rd)
            cause.tensor_parallel = tp_describe(a, b, cause)
            causes[rd.id] = cause
    if not hashed:
        mode = (f"replay bisection: the traces have no KV hashes, so steps were bisected by replay "
                f"({replays} replays)") if replay_bisector is not None else "none: no KV hashes and no replay"
    for cause in causes.values():
        as_environment_cause(a, b, cause)
    if confirm and replayer is not None and hashed:
        for rid, cause in causes.items():
            cause.confirmed, cause.confirm_detail = replayer(cause, next(r for r in d.requests if r.id == rid))
    if op_finder is not None and hashed:
        for rid, cause in causes.items():
            cause.first_op, cause.first_op_detail = op_finder(cause, next(r for r in d.requests if r.id == rid))
    return BisectReport(d, causes, mode, confirm or not hashed, unexplained)
