"""One run of a request list: the step loop, and the public steps replay drives.

The loop reads: schedule -> launch (forward + sampling queued on the device) ->
collect (wait for the [rows] token ids) -> commit (scheduler bookkeeping, tokens)
-> events. While a decode step computes, the next one is already built and
queued when the schedule allows (mlx-lm's generate_step does the same with
mx.async_eval). A speculative round (draft steps, then the verify) is spec_round.py's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx

from ..core.events import (
    DRAFT_MODEL, SPEC_ACCEPTED, SPEC_CORRECTED, SPEC_NONE, TARGET, VERIFY, AllReduce, RequestEvent, RunInfo,
    StepEvent, StepKernels, StepPlan, kernel_choice,
)
from ..core.names import WARM, WARMUP_PREFIX
from ..core.request import Request
from . import sampling as smp
from .kernel_sink import KernelSink
from .kernels.environment import environment
from .kv_events import KvLog, StepKv, kv_writes
from .model_state import ModelState
from .model.moe import routing_events
from .results import RequestOutput, RunResult
from .sched.scheduler import Scheduler, Work, blocks_needed, phases
from .sched.sequence import Sequence
from .spec_round import SpecRound
from .speculative import Proposal, accept_greedy, accept_sampled

_NO_SPEC = (SPEC_NONE,)  # the spec code of a decode row's one token


@dataclass
class Launch:
    """A step whose forward pass and sampling are queued on the device."""

    plan: StepPlan
    state: ModelState
    sample: smp.DeviceSample
    kv: StepKv | None  # the K/V the step wrote, as hashed (when observers want KV hashes)
    routing: list | None  # MoE layers' router choices (moe.LayerRouting), when asked
    kernels: StepKernels  # the step's kernel choices as rows (and all-reduces, when `mixed`), emitted at collect
    t0: float
    duration: float = 0.0
    mixed: bool = False  # event objects among the kernel rows (all-reduces): emitted one by one


class Run:
    """One execution of a request list: the step loop and the run's results. Each request's
    state is its Sequence, written by the Scheduler alone (sched/scheduler.py).

    `execute()` schedules and runs everything. Replay (replay.py) drives the same
    object through its public steps instead: `start()`, then per recorded plan
    `launch` / `collect` / `close`, emitting its tokens with `emit_token`, then `end(completed)`.
    A run that takes requests while it runs (serve.live.LiveRun) overrides `more_work`, and
    there admits and cancels requests through `admit` and `cancel`.
    """

    def __init__(self, engine, requests: list[Request], schedule: str, *, bad: dict[str, str] | None = None,
                 forced: dict | None = None, recorded: bool = False, spec_control=None):
        """spec_control: picks each speculative round's draft length, up to the engine's
        spec_k (speculative.AdaptiveDraft, serve --spec-adaptive's); None: spec_k every round."""
        self.e = engine
        self.schedule = schedule
        self.spec_control = spec_control
        self.requests = list(requests)
        self.bad = dict(bad or {})
        self.seqs = [Sequence.of(r, engine.prefill) for r in requests if r.id not in self.bad]
        # the schedule's phases: warm is a batched warm-up of the same prompts, then the run
        # (replay's requests already hold the warm-up: it runs the recorded plans as they are)
        self.phases = [(self.seqs, schedule)] if recorded else phases(
            self.seqs, schedule, lambda r: Sequence.of(r, engine.prefill))
        num_blocks = engine.num_blocks or blocks_needed(self.seqs, engine.block_size, engine.spec_k + 1,
                                                        copies=len(self.phases))
        self.want_kv = engine.wants("wants_kv_hashes")
        self.want_routing = engine.wants("wants_routing")
        self.want_records = engine.wants("wants_records")
        self._kernels = KernelSink()
        emit_k = self._kernels if engine.wants("wants_kernels") else None
        prefix = engine.prefix_caching or schedule == WARM
        self.target = ModelState(engine.target, engine._target_fwd, engine.policy, TARGET, num_blocks,
                                 engine.block_size, prefix, emit_k)
        self.draft = None
        if engine.draft is not None:
            self.draft = ModelState(engine.draft, engine._draft_fwd, engine.policy, DRAFT_MODEL, num_blocks,
                                    engine.block_size, False, emit_k)
        for st in (self.target, self.draft):
            if st is not None:
                st.dispatch.forced = dict(forced or {})
        # the warm-up's requests come first, as the trace lists them
        self.requests = [q.request for seqs, _ in self.phases[:-1] for q in seqs] + self.requests
        self.kv_log = KvLog(self.target.forward.num_layers)
        self.by_id = {r.id: r for r in self.requests}
        self.step = 0  # index of the next step to plan
        self.target_steps = 0
        self.outputs: dict[str, RequestOutput] = {}  # the run's results, by request id
        self._done_at = 0.0  # when the last collected step's results arrived
        self._side = None  # a second stream for host-side conversions (see emit_step_writes)
        self._t0 = 0.0

    # -- lifecycle ---------------------------------------------------------------------
    def info(self) -> RunInfo:
        e = self.e
        return RunInfo(schedule=self.schedule, policy=str(e.policy), settings=e.settings(), requests=self.requests,
                       model=e.target.describe(), draft=e.draft.describe() if e.draft else None,
                       environment=environment(), vocab=e.vocab_pieces() if e.observers else ())

    def start(self) -> None:
        self._t0 = self._done_at = time.perf_counter()
        self.e.emit("on_run_start", self.info())
        for rid, msg in self.bad.items():
            self.e.emit("on_request", RequestEvent(0, rid, "error", msg))

    def end(self, completed: bool) -> None:
        self.e.emit("on_run_end", completed)

    def execute(self) -> RunResult:
        self.start()
        completed = False
        try:
            for seqs, schedule in self.phases:
                self._drain(Scheduler(seqs, schedule=schedule, token_budget=self.e.token_budget,
                                      blocks=self.target.blocks, draft_blocks=self.draft.blocks if self.draft else None,
                                      spec_k=self.e.spec_k, stop_ids=self.e.eos_ids if self.e.stop_at_eos else ()))
            completed = True
        finally:
            self.end(completed)
        for r in self.requests:
            if r.id.startswith(WARMUP_PREFIX):
                self.outputs.pop(r.id, None)  # the warm-up is part of the schedule, not a result
                continue
            self.outputs.setdefault(r.id, RequestOutput(r.id, list(r.prompt_tokens), [], "", "error",
                                                        error=self.bad.get(r.id, "not run")))
        held = self.target.blocks.in_use + (self.draft.blocks.in_use if self.draft else 0)
        return RunResult(self.schedule, str(self.e.policy), self.outputs, self.step, self.target_steps,
                         time.perf_counter() - self._t0, held, self.target.blocks.hits)

    # -- the step loop -------------------------------------------------------------------
    def _drain(self, sched: Scheduler) -> None:
        """Run one scheduler's requests to completion."""
        clock = 0
        ahead: Launch | None = None  # the next decode step, queued before this one's tokens came back
        while self.more_work(sched, clock):
            work, admitted = sched.schedule(clock)
            if not work:  # idle until the next arrival
                clock = max(clock + 1, sched.next_arrival() or 0)
                continue
            self._arrived(admitted)
            decoding = [w.seq for w in work if not w.prefill]
            rnd = SpecRound(self, sched, work, decoding) if self.draft is not None and decoding else None
            if rnd is not None and rnd.drafting:
                ahead = None  # (a decode queued ahead is superseded: the verify rewrites its position)
                verify, sampled, proposals = rnd.execute()
                self.commit(sched, verify, sampled, proposals)
            else:
                # also a round the draft-length control gave no drafts (serve --spec-adaptive):
                # a plain decode step, so that it may queue the next one ahead as any decode does
                t0 = time.perf_counter()
                plan = sched.target_plan(self.take_step(), work)
                if ahead is not None and _same_layout(ahead.plan, plan):
                    launch, launch.plan = ahead, plan  # the guess holds: its input tokens were right
                else:
                    launch = self.launch(self.target, plan, full_rows=self.full_rows(plan))
                ahead = None
                nxt = sched.next_decode(work, clock) if self.e.overlap and (rnd is None or rnd.next_plain) else None
                if nxt is not None and all(w.seq.request.sampling.greedy for w in nxt):
                    ahead = self._launch_ahead(sched, launch, nxt)
                sampled = self.collect(launch)
                self.commit(sched, launch, sampled)
                if rnd is not None:
                    rnd.observed(time.perf_counter() - t0)
            clock += 1

    # -- hooks of a run that takes requests while it runs (serve.live.LiveRun) --------------
    def more_work(self, sched: Scheduler, clock: int) -> bool:
        """Whether the loop plans another step. Between steps: an override may `admit` and
        `cancel` requests here."""
        return not sched.done()

    def admit(self, sched: Scheduler, request: Request) -> None:
        """A request that arrived while the run runs (its arrival: the loop's clock) joins it."""
        self.requests.append(request)
        self.by_id[request.id] = request
        # the writer gives it its row before any event names it
        self.e.emit("on_request_added", request, only="on_request_added")
        sched.add(Sequence.of(request, self.e.prefill))

    def cancel(self, sched: Scheduler, request_id: str, *, reason: str, kind: str) -> bool:
        """Between steps: end a request before it finished (its output: what it generated so
        far, finish reason `reason`; event `kind`). False when it had finished already."""
        seq = sched.may_cancel(request_id, reason)
        if seq is None:
            return False
        step = max(self.step - 1, 0)  # the last step that ran: a reader shows events of steps it holds
        self.e.emit("on_request", RequestEvent(step, request_id, kind, reason))
        self.outputs[request_id] = RequestOutput(request_id, list(seq.request.prompt_tokens), seq.generated, "",
                                                 reason)
        return True

    def forget(self, sched: Scheduler, request_id: str) -> None:
        """Keep no result or state of a finished request (a server runs for days)."""
        self.outputs.pop(request_id, None)
        sched.forget(request_id)

    def take_step(self) -> int:
        """The index of the next step, taken by the plan about to be launched."""
        self.step += 1
        return self.step - 1

    def _launch_ahead(self, sched: Scheduler, launch: Launch, nxt: list[Work]) -> Launch:
        """Queue the next decode step, its input tokens taken on the device from this one."""
        plan = sched.target_plan(self.step, nxt, ahead=1)
        row = {sl.request_id: i for i, sl in enumerate(launch.plan.slices)}  # all-decode: one row a slice
        idx = [row[w.seq.id] for w in nxt]
        ids = launch.sample.ids
        tokens = ids if idx == list(range(ids.shape[0])) else ids[mx.array(idx, dtype=mx.int32)]
        return self.launch(self.target, plan, tokens=tokens)

    def emit_draws(self, step: int, rid: str, draws: list) -> None:
        """The sampler's uniform draws, as records of the trace's draws table."""
        if not self.want_records:
            return
        for pos, d in draws:
            cols = d.record(step, rid, pos)
            self.e.emit("on_record", "draws", only="wants_records", **cols)

    # -- public steps (the loop above and replay use them) ---------------------------------
    def state(self, model: str) -> ModelState:
        st = self.draft if model == DRAFT_MODEL else self.target
        if st is None:
            raise ValueError("the trace has draft steps but no draft model was given")
        return st

    def full_rows(self, plan: StepPlan) -> list[int]:
        """Logit rows whose requests sample with temperature (they need full logits)."""
        out, r = [], 0
        for sl in plan.slices:
            n = len(sl.logit_rows)
            if not self.by_id[sl.request_id].sampling.greedy:
                out += range(r, r + n)
            r += n
        return out

    def launch(self, state: ModelState, plan: StepPlan, *, tokens: mx.array | None = None, full_rows=(),
               want_topk: bool = True) -> Launch:
        """Build the step's forward and sampling graph and queue it (mx.async_eval)."""
        t0 = time.perf_counter()
        sink = self._kernels
        kbuf = StepKernels(plan.index, [])
        sink.buf, sink.step, sink.mixed = kbuf.rows, plan.index, False  # the build's events wait for the collect
        try:
            out = state.forward_step(plan, keep_kv=self.want_kv, keep_routing=self.want_routing, tokens=tokens)
        finally:
            sink.buf = None
        logits = out.logits
        if state is self.draft and self.e.draft_width < logits.shape[-1]:  # a padded draft head: ids the target lacks
            logits = logits[:, : self.e.draft_width]
        ds = smp.sample_on_device(logits, top_k=self.e.top_k, full_rows=full_rows, want_topk=want_topk,
                                   values=self.e.topk_values)
        kv = StepKv.of(out.k_written, out.v_written) if self.want_kv else None
        routing = [a for r in out.routing or () for a in r.arrays()]
        mx.async_eval(*ds.arrays(), *(kv.arrays() if kv else ()), *routing, *state.cache.arrays())
        return Launch(plan, state, ds, kv, out.routing, kbuf, t0, mixed=sink.mixed)

    def collect(self, launch: Launch, *, emit: bool = True) -> smp.Sampled:
        """Wait for a step's results; emits its kernel choices and KV writes (unless emit=False:
        then emit_step_writes later, once its plan's tokens are known)."""
        sampled = smp.to_host(launch.sample)
        now = time.perf_counter()
        launch.duration = now - max(launch.t0, self._done_at)
        self._done_at = now
        if emit:
            self.emit_step_writes(launch)
        return sampled

    def emit_step_writes(self, launch: Launch) -> None:
        if launch.kernels.rows:
            self._emit_kernels(launch.kernels, launch.mixed)
        if self.want_kv:
            writes = kv_writes(launch.plan, launch.state.name, launch.kv)
            self.e.emit("on_kv_writes", writes)  # (a list a step: one call, not one per write)
            if launch.state.blocks.prefix_caching:
                self.kv_log.record(writes)
        if launch.routing:
            # routing_events converts on the device: on a side stream, so its ops need not wait
            # behind the next step, already queued on the main one
            if self._side is None:
                self._side = mx.new_stream(mx.default_device())
            with mx.stream(self._side):
                events = routing_events(launch.plan, launch.state.name, launch.routing)
            for r in events:
                self.e.emit("on_routing", r)

    def _emit_kernels(self, kernels: StepKernels, mixed: bool) -> None:
        """A step's kernel choices in one on_kernels call (rows: StepKernels); with all-reduces
        among them, every event on its own, in order."""
        if not mixed:
            self.e.emit("on_kernels", kernels)
            return
        for ev in kernels.rows:
            if type(ev) is tuple:
                self.e.emit("on_kernel", kernel_choice(kernels.step, ev))
            else:
                self.e.emit("on_allreduce" if isinstance(ev, AllReduce) else "on_kernel", ev)

    def close(self, launch: Launch) -> None:
        """The step is over: on_step (a writer flushes there)."""
        self.e.emit("on_step", StepEvent(launch.plan, launch.duration))
        if launch.plan.model != DRAFT_MODEL:
            self.target_steps += 1

    def emit_token(self, event) -> None:
        self.e.emit("on_token", event)

    def emit_request(self, event: RequestEvent) -> None:
        self.e.emit("on_request", event)

    def follow(self, plan: StepPlan) -> None:
        """A recorded plan is being run (replay): the step counter is its index."""
        self.step = plan.index + 1

    # -- commits and events ----------------------------------------------------------------
    def _arrived(self, admitted: list[Sequence]) -> None:
        for seq in admitted:
            self.e.emit("on_request", RequestEvent(self.step, seq.id, "arrived", f"prefix_hit={seq.num_cached}"))
            if seq.num_cached and self.want_kv:
                self.emit_shared(seq.id, seq.num_cached)

    def emit_shared(self, rid: str, cached: int) -> None:
        """A prefix hit reads K/V that another request wrote: record them as this request's
        live writes, with the step that really wrote them."""
        blocks = self.target.blocks
        sources = [blocks.origin[b] for b in blocks.tables[rid][: cached // blocks.block_size]]
        self.e.emit("on_kv_writes", list(self.kv_log.shared(rid, sources, blocks.block_size)))

    def commit(self, sched: Scheduler, launch: Launch, sampled: smp.Sampled,
               proposals: dict[str, Proposal] | None = None) -> None:
        """A collected step's tokens: the scheduler takes what it computed, the acceptance of
        each verify (proposals: request id -> the draft tokens it checked) and each token;
        then the events, and the finished requests leave."""
        plan = launch.plan
        sched.computed(plan)
        r = 0
        done = []  # sequences this step finished, in plan order
        by_id = sched.by_id
        for sl in plan.slices:
            seq = by_id[sl.request_id]
            n = len(sl.logit_rows)
            if sl.phase == VERIFY:
                prop = proposals[seq.id]
                if seq.request.sampling.greedy:
                    j, toks = accept_greedy(prop.tokens, sampled.ids[r : r + n])
                else:
                    rec: list = []
                    j, toks = accept_sampled(prop, sampled.rows(r, r + n), seq.request.sampling, len(seq.tokens),
                                             draws=rec)
                    self.emit_draws(plan.index, seq.id, rec)
                sched.accepted(seq, len(prop.tokens), j)
                self._append(sched, seq, toks, plan.index, sampled, r, [SPEC_ACCEPTED] * j + [SPEC_CORRECTED])
            elif n:
                rec = []
                tok = smp.choose(seq.request.sampling, sampled, r, len(seq.tokens), draws=rec)
                if rec:
                    self.emit_draws(plan.index, seq.id, rec)
                self._append(sched, seq, (tok,), plan.index, sampled, r, _NO_SPEC)
            r += n
            if seq.finished:
                done.append(seq)
        for seq in done:
            self._finish(sched, seq, plan.index)
        self.close(launch)

    def _append(self, sched: Scheduler, seq: Sequence, toks, step: int, sampled: smp.Sampled, row: int,
                spec) -> None:
        for i, tok in enumerate(toks):
            if seq.finished:
                break
            ev = smp.token_event(step, seq.id, len(seq.tokens), tok, spec[i], sampled, row + i,
                                 sampling=seq.request.sampling)
            sched.append_token(seq, tok, ev.topk_ids, ev.topk_logits)
            self.e.emit("on_token", ev)

    def _finish(self, sched: Scheduler, seq: Sequence, step: int) -> None:
        sched.finish(seq)
        self.outputs[seq.id] = RequestOutput(
            seq.id, list(seq.request.prompt_tokens), seq.generated, self.e.decode(seq.generated),
            seq.finish_reason, topk_ids=seq.topk_ids, topk_logits=seq.topk_logits, proposed=seq.proposed,
            accepted=seq.accepted,
        )
        self.e.emit("on_request", RequestEvent(step, seq.id, "finished", seq.finish_reason))


def _same_layout(a: StepPlan, b: StepPlan) -> bool:
    """Same step, same rows: everything but the (pending) input tokens."""
    return a.index == b.index and a.model == b.model and len(a.slices) == len(b.slices) and all(
        (x.request_id, x.phase, x.start, x.count, x.row_offset, x.logit_rows)
        == (y.request_id, y.phase, y.start, y.count, y.row_offset, y.logit_rows) for x, y in zip(a.slices, b.slices))
