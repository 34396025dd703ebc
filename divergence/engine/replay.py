"""Re-execute recorded step plans exactly, optionally forcing kernels at chosen steps.

Replay is teacher-forced: every step's input rows are the recorded ones (the
plans carry their token ids), so the batch composition, row counts and
positions are exactly the recorded run's, whatever the replay computes. At
every site where the recording committed a token, the replay reports the token
its own logits pick and their top-k, so its trace diffs against any other.

Sampling replays the recorded uniforms (the trace's draws table; traces without
one get the same keyed uniforms the engine drew), and a sampled verify re-runs
the rejection test on the replay's own target p and draft q: an unforced replay
accepts exactly what the recording accepted, a forced one decides for itself.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from . import sampling as smp
from .kernels.dispatch import KernelPolicy
from .engine import Engine, RequestOutput, RunResult
from ..core.events import DRAFT_MODEL, VERIFY, RequestEvent, StepPlan
from ..core.names import DRAW_PURPOSES
from ..core.request import Request
from .run import Launch, Run
from .sched.scheduler import admit_recorded


@dataclass(frozen=True)
class TokenSite:
    """Where the recording committed a token: replay reports its own choice there."""

    step: int
    request_id: str
    position: int
    spec: int


@dataclass
class OpTap:
    """Record every op's output rows of one step for one request (analysis.ops compares them):
    (layer, op) -> {position: float32 row}, in the order the forward ran them."""

    step: int
    request_id: str
    rows: dict[int, int] = field(default_factory=dict)  # position -> row of the step's packed input
    outputs: dict = field(default_factory=dict)
    order: list = field(default_factory=list)
    _pending: list = field(default_factory=list)

    def bind(self, plan: StepPlan):
        """The tap function for this step's forward (None when the request is not in it)."""
        sl = next((s for s in plan.slices if s.request_id == self.request_id), None)
        if sl is None:
            return None
        self.rows = {sl.start + i: sl.row_offset + i for i in range(sl.count)}
        logit_row, r = {}, 0  # "norm" / "lm_head" see only the logit rows
        for s in plan.slices:
            for lr in s.logit_rows:
                if s is sl:
                    logit_row[sl.start + lr] = r
                r += 1
        total = plan.rows

        def tap(layer, op, rows):
            pick = self.rows if rows.shape[0] == total else logit_row
            self._pending.append(((int(layer), str(op)), pick, rows))

        return tap

    def finish(self) -> None:
        """After the step evaluated: keep the request's rows as float32 (exact for bf16/fp16)."""
        import mlx.core as mx

        for key, pick, rows in self._pending:
            if key not in self.outputs:
                self.order.append(key)
            full = np.array(rows.astype(mx.float32)).reshape(rows.shape[0], -1)
            self.outputs[key] = {p: full[r] for p, r in pick.items() if r < full.shape[0]}
        self._pending = []


def replay_plans(
    engine: Engine,
    requests: list[Request],
    plans: list[StepPlan],
    sites: list[TokenSite],
    *,
    schedule: str,
    forced: dict[int, KernelPolicy] | None = None,
    draws: dict | None = None,
    tap: "OpTap | None" = None,
    stop_after: int | None = None,
    admit_at: dict | None = None,
    stand_ins: frozenset = frozenset(),
) -> RunResult:
    """Run `plans` as recorded (a forcing's relayout is already applied: analysis/relayout.py).
    draws: (request, position, purpose) -> the recorded uniform. tap: record one step's
    op outputs for one request. stop_after: end after that step. admit_at: (model,
    request) -> where to admit a request whose first slice starts later (a relayout
    that recomputes part of a prefix hit). stand_ins: requests whose rows only hold their
    place in a sparse replay (analysis/sparse.py): admitted at their first slice in `plans`
    over K/V they never computed, publishing no prefix, deciding no token."""
    run = engine.recorded_run(requests, schedule, forced=forced)  # recorded under the original schedule's name
    last_seen: dict[str, int] = {}
    reserve = {r.id: 0 for r in requests}
    for p in plans:
        for s in p.slices:
            last_seen[s.request_id] = p.index
            reserve[s.request_id] = max(reserve[s.request_id], s.start + s.count)
    by_step: dict[int, list[TokenSite]] = {}
    for site in sites:
        by_step.setdefault(site.step, []).append(site)
    req_by_id = {r.id: r for r in requests}
    out = _Decisions(run, req_by_id, draws or {}, stand_ins)

    e = engine
    t0 = time.perf_counter()
    run.start()
    completed = False
    try:
        for plan in plans:
            tapping = tap is not None and plan.index == tap.step
            launch, sampled = step_recorded(run, plan, reserve, tap=tap.bind(plan) if tapping else None,
                                            admit_at=admit_at or {}, stand_ins=stand_ins)
            if tapping:
                tap.finish()
            if plan.model == DRAFT_MODEL:
                out.proposals(plan, sampled.logits)
            else:
                out.sites(plan, by_step.get(plan.index, ()), sampled.logits, lambda i: sampled.ids[i],
                          lambda step, rid, pos, tok, spec, r, sampling:
                          smp.token_event(step, rid, pos, tok, spec, sampled, r, sampling=sampling))
            for rid, last in last_seen.items():
                if last == plan.index and plan.model != DRAFT_MODEL:
                    run.emit_request(RequestEvent(plan.index, rid, "finished", "replayed"))
            run.close(launch)
            if stop_after is not None and plan.index >= stop_after:
                break
        completed = stop_after is None
    finally:
        run.end(completed)
    outputs = {
        r.id: RequestOutput(r.id, list(r.prompt_tokens), out.generated[r.id], e.decode(out.generated[r.id]),
                            "replayed", topk_ids=out.topk[r.id][0], topk_logits=out.topk[r.id][1])
        for r in requests
    }
    return RunResult(schedule, str(e.policy), outputs, len(plans), run.target_steps, time.perf_counter() - t0)


class _Decisions:
    """The replay's own decisions at the recorded sites, and their events. Sampling uses the
    recorded uniforms (keyed ones for traces without draws); a sampled verify re-runs the
    rejection test on the replay's own target p and the draft q its draft steps computed."""

    def __init__(self, run, req_by_id: dict, draws: dict, stand_ins: frozenset = frozenset()):
        self.run = run
        self.req = req_by_id
        self.draws = draws
        self.stand_ins = stand_ins
        self.q: dict[tuple[str, int], np.ndarray] = {}  # (request, position) -> the draft's q there
        self.generated: dict[str, list[int]] = {r: [] for r in req_by_id}
        self.topk = {r: ([], []) for r in req_by_id}
        self.records = run.e.wants("wants_records")

    def uniform(self, rid: str):
        sampling = self.req[rid].sampling

        def u(position: int, purpose: int) -> float:
            got = self.draws.get((rid, position, DRAW_PURPOSES[purpose]))
            return got if got is not None else smp.uniform(sampling, position, purpose)

        return u

    def emit_draw(self, step: int, rid: str, position: int, d) -> None:
        if self.records:
            self.run.emit_draws(step, rid, [(position, d)])

    def proposals(self, plan: StepPlan, logits) -> None:
        """A draft step: each sampled request's q at the position it predicts (its draw recorded)."""
        for i, s in enumerate(plan.slices):
            sampling = self.req[s.request_id].sampling
            if sampling.greedy or not s.logit_rows or s.request_id in self.stand_ins:
                continue
            pos = s.start + s.count
            q = smp.probs(logits(i), sampling)
            self.q[(s.request_id, pos)] = q
            _, d = smp.draw_traced(q, self.uniform(s.request_id)(pos, smp.PURPOSE_DRAFT), smp.PURPOSE_DRAFT)
            self.emit_draw(plan.index, s.request_id, pos, d)

    def sites(self, plan: StepPlan, sites, logits, argmax, event) -> None:
        """logits(r): float32 row r; argmax(r): the greedy token; event(...) -> TokenEvent."""
        from .speculative import Proposal, accept_sampled

        row_of, r = {}, 0  # logit row of (request, predicted position): rows come in slice order
        first_row: dict[str, int] = {}
        for s in plan.slices:
            first_row[s.request_id] = r
            for lr in s.logit_rows:
                row_of[(s.request_id, s.start + lr + 1)] = r
                r += 1
        chosen: dict[tuple[str, int], int] = {}
        for s in plan.slices:
            sampling = self.req[s.request_id].sampling
            if s.phase != VERIFY or sampling.greedy or s.request_id in self.stand_ins:
                continue
            rid, props = s.request_id, list(s.tokens[1:])
            qs = [self.q.get((rid, s.start + 1 + j)) for j in range(len(props))]
            if any(q is None for q in qs):
                raise ValueError(f"replay of {rid!r}: no draft distribution for the verify at step {plan.index}")
            r0 = first_row[rid]
            rows = np.stack([logits(x) for x in range(r0, r0 + len(s.logit_rows))])
            rec: list = []
            _, toks = accept_sampled(Proposal(props, qs), rows, sampling, s.start + 1, draws=rec,
                                     uniform=self.uniform(rid))
            for pos, d in rec:
                self.emit_draw(plan.index, rid, pos, d)
            for i, t in enumerate(toks):
                chosen[(rid, s.start + 1 + i)] = int(t)
        for site in sorted(sites, key=lambda x: (x.request_id, x.position)):
            r = row_of.get((site.request_id, site.position))
            if r is None or site.request_id in self.stand_ins:
                continue
            key = (site.request_id, site.position)
            sampling = self.req[site.request_id].sampling
            tok = chosen.get(key)
            if tok is None and sampling.greedy:
                tok = int(argmax(r))
            elif tok is None:  # a plain sample, or a verify row past where the replay itself rejected
                u = self.uniform(site.request_id)(site.position, smp.PURPOSE_SAMPLE)
                tok, d = smp.draw_traced(smp.probs(logits(r), sampling), u)
                if not any(s.request_id == site.request_id and s.phase == VERIFY for s in plan.slices):
                    self.emit_draw(plan.index, site.request_id, site.position, d)
            ev = event(plan.index, site.request_id, site.position, tok, site.spec, r, sampling)
            self.generated[site.request_id].append(tok)
            self.topk[site.request_id][0].append(ev.topk_ids)
            self.topk[site.request_id][1].append(ev.topk_logits)
            self.run.emit_token(ev)


def recorded_draws(trace) -> dict[tuple[str, int, str], float]:
    """(request, position, purpose) -> u from a trace's draws table (the last drawn for each;
    empty for traces recorded before draws were)."""
    try:
        t = trace.table("draws")
    except (KeyError, AttributeError):
        return {}
    if not len(t.get("step", ())):
        return {}
    ids = [r.id for r in trace.requests]
    out: dict = {}
    order = np.argsort(np.asarray(t["step"]), kind="stable")
    for i in order:
        purpose = t["purpose"][i]
        purpose = purpose if isinstance(purpose, str) else DRAW_PURPOSES[int(purpose)]
        out[(ids[int(t["request"][i])], int(t["position"][i]), str(purpose))] = float(t["value"][i])
    return out


def step_recorded(run: Run, plan: StepPlan, reserve: dict[str, int], *, tap=None,
                  admit_at: dict | None = None, stand_ins: frozenset = frozenset()) -> tuple[Launch, smp.Sampled]:
    """Replay: run a recorded plan exactly (teacher-forced), admitting its requests as the
    recording did; returns the collected step (kernels and KV writes emitted). tap: the
    forward's per-op output tap for this step (see forward.py). admit_at: (model, request) ->
    the position to admit it at, where it is not its first slice's start (a relayout
    recomputing part of a recorded prefix hit)."""
    state = run.state(plan.model)
    prefix = state.blocks.prefix_caching
    for s in plan.slices:
        if s.request_id in stand_ins:
            if s.request_id not in state.blocks.tables:  # its place only: no prefix to match
                state.blocks.allocate(s.request_id, reserve[s.request_id])
            continue
        if s.request_id not in state.blocks.tables:
            start = (admit_at or {}).get((plan.model, s.request_id), s.start)
            matched = admit_recorded(state.blocks, run.by_id[s.request_id], reserve[s.request_id], start,
                                     prefix=prefix)
            if matched and run.want_kv:
                run.emit_shared(s.request_id, matched)
    state.tap = tap
    try:
        launch = run.launch(state, plan, full_rows=run.full_rows(plan), want_topk=plan.model != DRAFT_MODEL)
    finally:
        state.tap = None
    run.follow(plan)
    sampled = run.collect(launch)
    if prefix:
        for s in plan.slices:
            if s.phase == "prefill" and s.request_id not in stand_ins:
                state.blocks.register_prefix(s.request_id, run.by_id[s.request_id].prompt_tokens,
                                             s.start + s.count)
    return launch, sampled

