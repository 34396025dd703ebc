"""The step loop: scheduler -> (draft proposals) -> packed forward -> sampler -> events.

    engine = Engine(load_model(path), policy="native")
    result = engine.run([Request("r1", tuple(engine.encode("Hello")), max_tokens=32)], schedule="concurrent")
    result.outputs["r1"].text
"""
from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from ..errors import PromptError
from . import sampling as smp
from .dispatch import KernelPolicy
from ..core.events import (
    DECODE,
    DRAFT,
    DRAFT_MODEL,
    PREFILL,
    SPEC_ACCEPTED,
    SPEC_CORRECTED,
    SPEC_NONE,
    TARGET,
    VERIFY,
    KvWrite,
    Observer,
    RequestEvent,
    RunInfo,
    SeqSlice,
    StepEvent,
    StepPlan,
    TokenEvent,
)
from .forward import PackedForward
from .model import LoadedModel
from ..core.names import WARMUP_PREFIX
from ..core.request import Request
from .sequence import Sequence
from ..core.names import CONCURRENT, SCHEDULES, SERIAL, WARM
from .scheduler import Scheduler, Work
from .environment import environment
from .results import RequestOutput, RunResult
from .model_state import ModelState, kv_writes
from .moe import routing_events
from .speculative import Proposal, accept_greedy, accept_sampled

__all__ = ["Engine", "RequestOutput", "RunResult", "environment"]


class Engine:
    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | None = None,
        *,
        policy="native",
        token_budget: int = 256,
        spec_k: int = 0,
        top_k: int = 8,
        block_size: int = 16,
        num_blocks: int | None = None,
        prefix_caching: bool = False,
        stop_at_eos: bool = True,
        observers: list[Observer] | tuple = (),
        tp=None,
    ):
        self.target = target
        self.draft = draft if spec_k > 0 else None
        if spec_k > 0 and draft is None:
            raise PromptError("speculative decoding (spec_k > 0) needs a draft model")
        if spec_k < 0:
            raise PromptError(f"spec_k must be >= 0, got {spec_k}")
        self.policy = KernelPolicy.parse(policy)
        self.spec_k = spec_k
        if token_budget < spec_k + 1:
            raise PromptError(f"token budget {token_budget} is smaller than one verify ({spec_k + 1} rows)")
        self.token_budget = token_budget
        self.top_k = top_k
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self.stop_at_eos = stop_at_eos
        self.observers = list(observers)
        self._target_fwd = PackedForward(target)
        self._draft_fwd = PackedForward(self.draft) if self.draft else None
        # tensor parallel (engine.tp.TensorParallel of this process's group): shard both
        # models for this rank; its all-reduces are events like kernel choices
        self.tp = tp if tp is not None and tp.size > 1 else None
        if self.tp is not None:
            from .tp import shard_forward

            for fwd in (self._target_fwd, self._draft_fwd):
                if fwd is not None:
                    shard_forward(fwd, self.tp, keep_full=self.tp.keep_full)
            self.tp.emit = lambda e: self._emit("on_allreduce", e)
        eos = getattr(target.tokenizer, "eos_token_ids", None) or []
        self.eos_ids = set(int(t) for t in eos)
        self.vocab = self._target_fwd.head.n
        self.forced: dict[int, KernelPolicy] = {}
        self._vocab: list[str] | None = None

    # -- convenience -------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.target.encode(text)

    def decode(self, tokens) -> str:
        return self.target.decode(tokens)

    def vocab_pieces(self) -> list[str]:
        """Each token id decoded alone (cached): traces store it so readers need no tokenizer."""
        if self._vocab is None:
            self._vocab = [self.target.decode([i]) for i in range(self.vocab)]
        return self._vocab

    def settings(self) -> dict:
        return {
            "policy": str(self.policy),
            "token_budget": self.token_budget,
            "spec_k": self.spec_k,
            "top_k": self.top_k,
            "block_size": self.block_size,
            "prefix_caching": self.prefix_caching,
            "stop_at_eos": self.stop_at_eos,
            "dtype": self.target.dtype,
            **({"tp": self.tp.describe()} if self.tp is not None else {}),
        }

    def check(self, req: Request) -> str:
        """Why a request cannot run ('' when it can)."""
        if any(t < 0 or t >= self.vocab for t in req.prompt_tokens):
            return f"request {req.id!r}: prompt has token ids outside the vocabulary (0..{self.vocab - 1})"
        ctx = self.target.context_length
        need = len(req.prompt_tokens) + req.max_tokens + self.spec_k
        if ctx and need > ctx:
            return (f"request {req.id!r}: prompt ({len(req.prompt_tokens)} tokens) + max_tokens ({req.max_tokens})"
                    f" exceeds the model's context of {ctx} tokens")
        return ""

    # -- the run ---------------------------------------------------------------------
    def run(self, requests: list[Request], schedule: str = "serial", *, strict: bool = True) -> RunResult:
        """Run requests under a schedule. strict: a bad request raises PromptError;
        otherwise it is reported in its output and the others run."""
        if schedule not in SCHEDULES:
            raise PromptError(f"unknown schedule {schedule!r} (expected one of {', '.join(SCHEDULES)})")
        ids = [r.id for r in requests]
        if len(set(ids)) != len(ids):
            raise PromptError("request ids must be unique")
        if not requests:
            raise PromptError("no requests to run")
        errors = {r.id: self.check(r) for r in requests}
        bad = {k: v for k, v in errors.items() if v}
        if bad and strict:
            raise PromptError(next(iter(bad.values())))
        return _Run(self, requests, schedule, bad).execute()

    # -- events -------------------------------------------------------------------------
    def _emit(self, method: str, *args) -> None:
        for ob in self.observers:
            getattr(ob, method)(*args)

    def _wants(self, attr: str) -> bool:
        return any(getattr(ob, attr, False) for ob in self.observers)


class _Run:
    """One execution of a request list; holds all per-run state."""

    def __init__(self, engine: Engine, requests: list[Request], schedule: str, bad: dict[str, str]):
        self.e = engine
        self.schedule = schedule
        self.requests = list(requests)
        self.bad = bad
        self.seqs = [Sequence(r) for r in requests if r.id not in bad]
        extra = engine.spec_k + 1
        need = (2 if schedule == WARM else 1) * sum(
            -(-(s.prompt_len + s.request.max_tokens + extra) // engine.block_size) for s in self.seqs)
        num_blocks = engine.num_blocks or max(need, 1)
        kernels = engine._wants("wants_kernels")
        emit_k = (lambda c: engine._emit("on_kernel", c)) if kernels else None
        self.target = ModelState(engine.target, engine._target_fwd, engine.policy, TARGET, num_blocks,
                                  engine.block_size, engine.prefix_caching, emit_k)
        self.target.dispatch.forced = dict(engine.forced)
        self.draft = None
        if engine.draft is not None:
            self.draft = ModelState(engine.draft, engine._draft_fwd, engine.policy, DRAFT_MODEL, num_blocks,
                                     engine.block_size, False, emit_k)
            self.draft.dispatch.forced = dict(engine.forced)
        # warm: the cache is first filled by other requests (the same prompts, batched),
        # then the requests run serially on top of it: "cold vs warm" as one more schedule.
        self.phases = [(self.seqs, schedule)]
        if schedule == WARM:
            self.target.blocks.prefix_caching = True
            warm = [Sequence(Request(WARMUP_PREFIX + q.id, q.request.prompt_tokens, max_tokens=1)) for q in self.seqs]
            self.phases = [(warm, CONCURRENT), (self.seqs, SERIAL)]
            self.requests = [q.request for q in warm] + self.requests
        self.extra = extra
        self.kv_live: dict = {}  # (request, layer, position) -> (step, k_hash, v_hash), prefix caching only
        self.want_kv = engine._wants("wants_kv_hashes")
        self.want_routing = engine._wants("wants_routing")
        self.step = 0
        self.target_steps = 0
        self.proposals: dict[str, Proposal] = {}
        self.outputs: dict[str, RequestOutput] = {}
        self.topk: dict[str, tuple[list, list]] = {r.id: ([], []) for r in self.requests}

    def info(self) -> RunInfo:
        e = self.e
        return RunInfo(schedule=self.schedule, policy=str(e.policy), settings=e.settings(), requests=self.requests,
                       model=e.target.describe(), draft=e.draft.describe() if e.draft else None,
                       environment=environment(), vocab=e.vocab_pieces() if e.observers else ())

    def execute(self) -> RunResult:
        e = self.e
        t0 = time.perf_counter()
        e._emit("on_run_start", self.info())
        for rid, msg in self.bad.items():
            e._emit("on_request", RequestEvent(0, rid, "error", msg))
        completed = False
        try:
            for seqs, schedule in self.phases:
                self._drain(Scheduler(seqs, schedule=schedule, token_budget=e.token_budget,
                                      blocks=self.target.blocks, reserve_extra=self.extra))
            completed = True
        finally:
            e._emit("on_run_end", completed)
        for r in self.requests:
            if r.id.startswith(WARMUP_PREFIX):
                self.outputs.pop(r.id, None)  # the warm-up is part of the schedule, not a result
                continue
            self.outputs.setdefault(r.id, RequestOutput(r.id, list(r.prompt_tokens), [], "", "error",
                                                        error=self.bad.get(r.id, "not run")))
        held = self.target.blocks.in_use + (self.draft.blocks.in_use if self.draft else 0)
        return RunResult(self.schedule, str(e.policy), self.outputs, self.step, self.target_steps,
                         time.perf_counter() - t0, held, self.target.blocks.hits)

    def _drain(self, sched: Scheduler) -> None:
        """Run one scheduler's requests to completion."""
        e = self.e
        self.sched = sched
        clock = 0
        while not sched.done():
            work, admitted = sched.schedule(clock, decode_rows=e.spec_k + 1 if self.draft else 1)
            if not work:  # idle until the next arrival
                clock = max(clock + 1, sched.next_arrival() or 0)
                continue
            for seq in admitted:
                e._emit("on_request", RequestEvent(self.step, seq.id, "arrived", f"prefix_hit={seq.num_cached}"))
                if seq.num_cached and self.want_kv:
                    self._emit_shared_kv(seq)
            self._target_step(work)
            clock += 1

    def _emit_shared_kv(self, seq: Sequence) -> None:
        """A prefix hit reads K/V that another request wrote: record them as this
        request's live writes, with the step that really wrote them."""
        blocks = self.target.blocks
        bs = blocks.block_size
        for i, b in enumerate(blocks.tables[seq.id][: seq.num_cached // bs]):
            owner, pos0 = blocks.origin[b]
            for layer in range(self.target.forward.num_layers):
                for p in range(bs):
                    step, kh, vh = self.kv_live[(owner, layer, pos0 + p)]
                    self.e._emit("on_kv_write", KvWrite(step, TARGET, seq.id, layer, i * bs + p, 1,
                                                        np.array([kh], np.uint64), np.array([vh], np.uint64)))

    # -- one target step (with its draft steps first, when speculating) ---------------
    def _target_step(self, work: list[Work]) -> None:
        decoding = [w.seq for w in work if not w.prefill]
        if self.draft is not None and decoding:
            self._propose(decoding)
        slices, row = [], 0
        for w in work:
            seq = w.seq
            if w.prefill:
                start, toks = seq.num_cached, seq.tokens[seq.num_cached : seq.num_cached + w.prefill]
                last = start + w.prefill == seq.prompt_len
                sl = SeqSlice(seq.id, PREFILL, start, len(toks), row, tuple(toks), (len(toks) - 1,) if last else ())
            elif self.draft is not None:
                prop = self.proposals[seq.id].tokens
                toks = [seq.tokens[-1]] + prop
                sl = SeqSlice(seq.id, VERIFY, len(seq.tokens) - 1, len(toks), row, tuple(toks),
                              tuple(range(len(toks))))
            else:
                sl = SeqSlice(seq.id, DECODE, len(seq.tokens) - 1, 1, row, (seq.tokens[-1],), (0,))
            slices.append(sl)
            row += sl.count
        plan = StepPlan(self.step, TARGET, tuple(slices))
        logits, greedy, logits_np = self._forward(self.target, plan)
        by_id = {w.seq.id: w for w in work}
        r = 0
        for sl in plan.slices:
            seq = by_id[sl.request_id].seq
            nrows = len(sl.logit_rows)
            if sl.phase == PREFILL:
                seq.num_cached = sl.start + sl.count
                self.target.blocks.register_prefix(seq.id, seq.tokens, seq.num_cached)
                if nrows:
                    tok = self._sample_one(seq, logits_np[r], greedy[r], len(seq.tokens))
                    self._commit(seq, [tok], plan.index, logits_np[r : r + 1], [SPEC_NONE])
            elif sl.phase == DECODE:
                seq.num_cached = sl.start + 1
                tok = self._sample_one(seq, logits_np[r], greedy[r], len(seq.tokens))
                self._commit(seq, [tok], plan.index, logits_np[r : r + 1], [SPEC_NONE])
            else:  # VERIFY
                prop = self.proposals.pop(seq.id)
                if seq.request.sampling.greedy:
                    j, toks = accept_greedy(prop.tokens, greedy[r : r + nrows])
                else:
                    j, toks = accept_sampled(prop, logits_np[r : r + nrows], seq.request.sampling, len(seq.tokens))
                seq.proposed += len(prop.tokens)
                seq.accepted += j
                n = len(seq.tokens)
                seq.num_cached = n + j  # rows past the accepted ones are rolled back (overwritten later)
                seq.draft_cached = min(seq.draft_cached, n + j)
                spec = [SPEC_ACCEPTED] * j + [SPEC_CORRECTED]
                self._commit(seq, toks, plan.index, logits_np[r : r + j + 1], spec)
            r += nrows
        for seq in [w.seq for w in work if w.seq.finished]:
            self._finish(seq, plan.index)
        self.e._emit("on_step", StepEvent(plan, self._last_duration))
        self.step += 1
        self.target_steps += 1

    def _propose(self, seqs: list[Sequence]) -> None:
        """k draft forward passes, batched across the decoding sequences."""
        d = self.draft
        ks = {s.id: min(self.e.spec_k, s.request.max_tokens - s.num_generated) for s in seqs}
        props = {s.id: Proposal([], []) for s in seqs}
        for j in range(max(ks.values())):
            slices, row = [], 0
            for s in seqs:
                if ks[s.id] <= j:
                    continue
                if s.id not in d.blocks.tables:
                    d.blocks.allocate(s.id, self.sched.reserve_len(s))
                if j == 0:
                    toks = s.tokens[s.draft_cached :]
                    start = s.draft_cached
                else:
                    toks = [props[s.id].tokens[-1]]
                    start = len(s.tokens) + j - 1
                slices.append(SeqSlice(s.id, DRAFT, start, len(toks), row, tuple(toks), (len(toks) - 1,)))
                row += len(toks)
            plan = StepPlan(self.step, DRAFT_MODEL, tuple(slices))
            _, greedy, logits_np = self._forward(d, plan)
            for i, sl in enumerate(plan.slices):
                s = next(x for x in seqs if x.id == sl.request_id)
                s.draft_cached = sl.start + sl.count
                if s.request.sampling.greedy:
                    props[s.id].tokens.append(int(greedy[i]))
                    props[s.id].q.append(None)
                else:
                    q = smp.probs(logits_np[i], s.request.sampling)
                    pos = len(s.tokens) + j
                    props[s.id].tokens.append(smp.draw(q, smp.uniform(s.request.sampling, pos, 3)))
                    props[s.id].q.append(q)
            self.step += 1
            self.e._emit("on_step", StepEvent(plan, self._last_duration))
        self.proposals.update(props)

    def _forward(self, state: ModelState, plan: StepPlan):
        t0 = time.perf_counter()
        out = state.forward_step(plan, keep_kv=self.want_kv, keep_routing=self.want_routing)
        greedy = smp.greedy_rows(out.logits)
        extra = (out.k_written, out.v_written) if self.want_kv else ()
        extra += tuple(a for r in out.routing or () for a in r.arrays())
        mx.eval(out.logits, greedy, *extra, *state.cache.arrays())
        self._last_duration = time.perf_counter() - t0
        if self.want_kv:
            remember = state.blocks.prefix_caching
            for w in kv_writes(plan, state.name, out.k_written, out.v_written):
                self.e._emit("on_kv_write", w)
                if remember:
                    for i in range(w.count):
                        self.kv_live[(w.request_id, w.layer, w.start + i)] = \
                            (plan.index, int(w.k_hashes[i]), int(w.v_hashes[i]))
        for r in routing_events(plan, state.name, out.routing) if out.routing else ():
            self.e._emit("on_routing", r)
        logits_np = np.array(out.logits.astype(mx.float32))
        return out.logits, [int(t) for t in np.array(greedy)], logits_np

    def _sample_one(self, seq: Sequence, logits_row: np.ndarray, greedy_tok: int, position: int) -> int:
        s = seq.request.sampling
        if s.greedy:
            return int(greedy_tok)
        return smp.draw(smp.probs(logits_row, s), smp.uniform(s, position))

    def _commit(self, seq: Sequence, toks: list[int], step: int, rows: np.ndarray, spec: list[int]) -> None:
        ids, vals = smp.topk(rows, self.e.top_k)
        for i, tok in enumerate(toks):
            if seq.finished:
                break
            pos = len(seq.tokens)
            seq.tokens.append(int(tok))
            self.topk[seq.id][0].append(ids[i])
            self.topk[seq.id][1].append(vals[i])
            self.e._emit("on_token", TokenEvent(step, seq.id, pos, int(tok), spec[i], ids[i], vals[i]))
            if self.e.stop_at_eos and tok in self.e.eos_ids:
                seq.finished, seq.finish_reason = True, "eos"
            elif seq.num_generated >= seq.request.max_tokens:
                seq.finished, seq.finish_reason = True, "length"

    def _finish(self, seq: Sequence, step: int) -> None:
        self.sched.finish(seq)
        if self.draft is not None:
            self.draft.blocks.free(seq.id)
        ids, vals = self.topk[seq.id]
        self.outputs[seq.id] = RequestOutput(
            seq.id, list(seq.request.prompt_tokens), seq.generated, self.e.decode(seq.generated),
            seq.finish_reason, topk_ids=ids, topk_logits=vals, proposed=seq.proposed, accepted=seq.accepted,
        )
        self.e._emit("on_request", RequestEvent(step, seq.id, "finished", seq.finish_reason))

    _last_duration = 0.0

