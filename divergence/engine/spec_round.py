"""One speculative round of the step loop: k draft steps batched across the decoding
sequences, then one verify step of the target.

With only greedy requests every step of the round is queued before its one host sync:
each draft step takes its input tokens on the device from the previous one's ids, and
the verify gathers its proposals from all of them (`_verify_tokens`). A round with a
sampling request collects each draft step before the next, since its proposal is a
host-side draw. Either way the round returns its collected verify and the proposals;
the Run (run.py) commits them through the scheduler, and emits the events; this module
only drives the round's steps.

A run's `spec_control` (speculative.AdaptiveDraft: `serve --spec-adaptive`'s; None: k every
round) picks each round's draft length, up to the engine's k, and is told how long the round took.
A round of no drafts is no speculative round: the Run steps it as a plain decode (phase
DECODE, the draft cache catching up at the next drafting round), which may queue the next
step ahead when the control already knows that one drafts nothing too.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

import mlx.core as mx

from ..core.events import StepPlan
from . import sampling as smp
from .sched.scheduler import PENDING, Scheduler, Work
from .sched.sequence import Sequence
from .speculative import Proposal

if TYPE_CHECKING:  # (run.py imports this module)
    from .run import Launch, Run


class SpecRound:
    def __init__(self, run: Run, sched: Scheduler, work: list[Work], decoding: list[Sequence]):
        self.run, self.sched, self.work, self.decoding = run, sched, work, decoding
        self.ks = {s.id: sched.draft_len(s) for s in decoding}  # draft steps per sequence
        self.control = run.spec_control
        if self.control is not None:
            k = self.control.choose(decoding, self.ks)
            self.ks = {i: min(n, k) for i, n in self.ks.items()}
        self.drafting = max(self.ks.values(), default=0) > 0  # else the Run steps it as a plain decode
        self.props = {s.id: Proposal([], []) for s in decoding}
        # draft steps queued but not collected, with the sequences of each (greedy rounds)
        self.queued: list[tuple[Launch, list[Sequence]]] = []

    @property
    def next_plain(self) -> bool:
        """Whether the next round is known to draft nothing (then this one, plain, may queue it ahead)."""
        peek = getattr(self.control, "next_k", None)  # (a control may not know ahead: then never)
        return peek is not None and peek() == 0

    def observed(self, seconds: float) -> None:
        """A round without drafts, stepped by the Run, took `seconds`."""
        if self.control is not None:
            self.control.observe(0, seconds)

    def execute(self) -> tuple[Launch, smp.Sampled, dict[str, Proposal]]:
        """Run the round: (the verify step's launch, its sampled rows, the proposals)."""
        run, sched, decoding, ks, props = self.run, self.sched, self.decoding, self.ks, self.props
        t0 = time.perf_counter()
        lazy = run.e.overlap and all(s.request.sampling.greedy for s in decoding)
        last: dict[str, int] = {}
        prev: Launch | None = None
        prev_row: dict[str, int] = {}
        for j in range(max(ks.values())):
            seqs = [s for s in decoding if ks[s.id] > j]
            plan = sched.draft_plan(run.take_step(), seqs, j, last)
            tokens = None
            if j and lazy:
                tokens = prev.sample.ids[mx.array([prev_row[s.id] for s in seqs], dtype=mx.int32)]
            full = [i for i, s in enumerate(seqs) if not s.request.sampling.greedy]
            launch = run.launch(run.draft, plan, tokens=tokens, full_rows=full, want_topk=False)
            sched.computed(plan)
            if lazy:
                self.queued.append((launch, seqs))
                prev, prev_row = launch, {s.id: i for i, s in enumerate(seqs)}
                last = {s.id: PENDING for s in seqs}
                continue
            sampled = run.collect(launch)
            for i, s in enumerate(seqs):
                tok, q = self._propose_one(s, sampled, i, len(s.tokens) + j, launch.plan.index)
                props[s.id].tokens.append(tok)
                props[s.id].q.append(q)
                last[s.id] = tok
            run.close(launch)
        if lazy:
            plan = sched.target_plan(run.take_step(), self.work, {s.id: (PENDING,) * ks[s.id] for s in decoding})
            # (every decoding sequence is greedy, but a prefill in the step may be of one that samples)
            verify = run.launch(run.target, plan, tokens=self._verify_tokens(plan), full_rows=run.full_rows(plan))
            self._collect_queued()
            verify.plan = with_tokens(verify.plan, {s: (seq.tokens[-1], *props[s].tokens)
                                                    for s, seq in ((x.id, x) for x in decoding)})
        else:
            plan = sched.target_plan(run.take_step(), self.work, {s.id: tuple(props[s.id].tokens) for s in decoding})
            verify = run.launch(run.target, plan, full_rows=run.full_rows(plan))
        sampled = run.collect(verify)
        if self.control is not None:
            self.control.observe(max(ks.values()), time.perf_counter() - t0)
        return verify, sampled, props

    def _propose_one(self, s: Sequence, sampled: smp.Sampled, row: int, pos: int, step: int):
        if s.request.sampling.greedy:
            return int(sampled.ids[row]), None
        q = smp.probs(sampled.logits(row), s.request.sampling)
        tok, rec = smp.draw_traced(q, smp.uniform(s.request.sampling, pos, smp.PURPOSE_DRAFT), smp.PURPOSE_DRAFT)
        self.run.emit_draws(step, s.id, [(pos, rec)])
        return tok, q

    def _verify_tokens(self, plan: StepPlan) -> mx.array:
        """The step's input rows: prefill rows and each verify's last token from the host,
        its proposals gathered on the device from the draft steps' ids."""
        known = [t for sl in plan.slices for t in sl.tokens if t != PENDING]
        pool = [mx.array(known, dtype=mx.uint32)]
        where: dict[tuple[str, int], int] = {}
        base = len(known)
        for j, (launch, seqs) in enumerate(self.queued):
            pool.append(launch.sample.ids.astype(mx.uint32))
            for i, s in enumerate(seqs):
                where[(s.id, j)] = base + i
            base += len(seqs)
        idx, k = [], 0
        for sl in plan.slices:
            for j, t in enumerate(sl.tokens):
                if t == PENDING:
                    idx.append(where[(sl.request_id, j - 1)])
                else:
                    idx.append(k)
                    k += 1
        return mx.concatenate(pool)[mx.array(idx, dtype=mx.int32)]

    def _collect_queued(self) -> None:
        """The round's one host sync: the draft steps' proposals, then their events. Each
        step's duration is the time from the previous step's results to its own."""
        run, props = self.run, self.props
        for j, (launch, seqs) in enumerate(self.queued):
            sampled = run.collect(launch, emit=False)
            if j:
                launch.plan = with_tokens(launch.plan, {s.id: (props[s.id].tokens[-1],) for s in seqs})
            for i, s in enumerate(seqs):
                props[s.id].tokens.append(int(sampled.ids[i]))
                props[s.id].q.append(None)
        for launch, _ in self.queued:
            run.emit_step_writes(launch)
            run.close(launch)


def with_tokens(plan: StepPlan, tokens: dict[str, tuple[int, ...]]) -> StepPlan:
    """The plan with its PENDING input tokens filled in, once the host has them."""
    return replace(plan, slices=tuple(replace(s, tokens=tuple(int(t) for t in tokens[s.request_id]))
                                      if s.request_id in tokens else s for s in plan.slices))
