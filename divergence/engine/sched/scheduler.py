"""Which sequences run in the next target step, how many rows each gets, and the
bookkeeping of what their caches hold.

Two policies over the same requests: `serial` runs one request at a time to
completion in arrival order; `concurrent` is continuous batching: running
requests' decode (or verify) rows first, then prefill chunks of new requests
packed into the same step up to a token budget. Admission reserves a request's
whole length in KV blocks (target and draft), so nothing is ever preempted
mid-run. The scheduler is the one writer of a request's state (sched.sequence.Sequence):
every block allocation, every `num_cached` / `draft_cached` update, the tokens a step
commits, acceptance, finish and cancel go through its named methods; the step loop
reports what a step computed and sampled.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ...core.events import DECODE, DRAFT, DRAFT_MODEL, PREFILL, TARGET, VERIFY, SeqSlice, StepPlan
from ...core.names import BASE_SCHEDULES, CONCURRENT, SERIAL, WARM, WARMUP_PREFIX
from ...core.request import Request
from .blocks import BlockManager
from .sequence import MLX_LM, PREFILL_LAYOUTS, WHOLE, Sequence  # noqa: F401  (the layouts: re-exported)

PENDING = -1  # a token id not known on the host yet (it is still being computed)


@dataclass
class Work:
    """One sequence's share of a target step."""

    seq: Sequence
    prefill: int = 0  # prompt rows to prefill this step (0 = decode/verify)


class Scheduler:
    def __init__(self, seqs: list[Sequence], *, schedule: str, token_budget: int, blocks: BlockManager,
                 draft_blocks: BlockManager | None = None, spec_k: int = 0, stop_ids=frozenset()):
        """stop_ids: the token ids that finish a request (end-of-text; empty: none does)."""
        assert schedule in BASE_SCHEDULES
        self.schedule_name = schedule
        self.budget = token_budget
        self.blocks = blocks
        self.draft_blocks = draft_blocks
        self.spec_k = spec_k if draft_blocks is not None else 0
        self.decode_rows = self.spec_k + 1  # rows of one decode (1) or verify (k+1)
        order = sorted(range(len(seqs)), key=lambda i: (seqs[i].request.arrival, i))
        self.waiting: deque[Sequence] = deque(seqs[i] for i in order)
        self.running: list[Sequence] = []
        self.by_id = {s.id: s for s in seqs}
        self.stop_ids = stop_ids

    def done(self) -> bool:
        return not self.waiting and not self.running

    def reserve_len(self, seq: Sequence) -> int:
        # + spec_k + 1: a verify may compute k rows past the last token it keeps
        return seq.prompt_len + seq.request.max_tokens + self.spec_k + 1

    def next_arrival(self) -> int | None:
        return self.waiting[0].request.arrival if self.waiting else None

    def add(self, seq: Sequence) -> None:
        """A request that arrived while the run runs (serve) joins the queue: arrivals only
        grow, so the queue stays in arrival order."""
        self.waiting.append(seq)
        self.by_id[seq.id] = seq

    # -- admission: the only place blocks are allocated ------------------------------------
    def can_admit(self, seq: Sequence, need: int) -> bool:
        """Whether both caches have `need` positions of blocks for seq (its prefix matched)."""
        return self.blocks.can_allocate(seq.id, need) and (
            self.draft_blocks is None or self.draft_blocks.can_allocate(seq.id, need))

    def _admit(self, clock: int, admitted: list[Sequence]) -> None:
        while self.waiting:
            seq = self.waiting[0]
            if self.schedule_name == CONCURRENT and seq.request.arrival > clock:
                return
            if self.schedule_name == SERIAL and self.running:
                return
            matched = self.blocks.match_prefix(seq.id, seq.request.prompt_tokens)
            need = self.reserve_len(seq)
            if not self.can_admit(seq, need):
                self.blocks.free(seq.id)  # undo the prefix match; wait for memory
                if not self.running:
                    raise RuntimeError(f"request {seq.id!r} needs more KV blocks than the cache has")
                return
            self.blocks.allocate(seq.id, need)
            if self.draft_blocks is not None:
                self.draft_blocks.allocate(seq.id, need)
            seq.num_cached = matched
            self.waiting.popleft()
            self.running.append(seq)
            admitted.append(seq)

    def schedule(self, clock: int) -> tuple[list[Work], list[Sequence]]:
        """Plan the next target step. Returns (work, newly admitted sequences)."""
        admitted: list[Sequence] = []
        self._admit(clock, admitted)
        work: list[Work] = []
        budget = self.budget
        for seq in self.running:  # decode / verify rows first: running requests never starve
            if not seq.in_prefill:
                work.append(Work(seq))
                budget -= self.decode_rows
        for seq in self.running:
            if seq.in_prefill and budget > 0:
                n = min(seq.prefill_end - seq.num_cached, budget)
                work.append(Work(seq, prefill=n))
                budget -= n
        return work, admitted

    def next_decode(self, work: list[Work], clock: int) -> list[Work] | None:
        """The work of the step after `work` (an all-decode step, not committed yet) if it is
        known before that step's tokens are: the same sequences decode again, less those that
        end by length, and nothing can be admitted. None when it is not predictable. A
        sequence ending by EOS makes the guess wrong; the step loop then rebuilds the step.
        With a draft model the caller asks only where the next round drafts nothing."""
        if not work or any(w.prefill for w in work):
            return None
        if self.waiting:
            nxt = self.waiting[0]
            if self.schedule_name == CONCURRENT and nxt.request.arrival <= clock + 1:
                return None
            if self.schedule_name == SERIAL and any(
                    w.seq.num_generated + 1 >= w.seq.request.max_tokens for w in work):
                return None
        if len(work) != len(self.running):
            return None
        keep = [Work(w.seq) for w in work if w.seq.num_generated + 1 < w.seq.request.max_tokens]
        return keep or None

    # -- step plans: the row layout of a step (slices in work order, rows contiguous) -----
    def target_plan(self, index: int, work: list[Work], proposals: dict | None = None, *,
                    ahead: int = 0) -> StepPlan:
        """The target step of `work`. proposals: request id -> draft tokens (verify rows);
        ahead=1 plans a decode step one position past the committed tokens (its input token
        is PENDING: the step before it has not returned it yet)."""
        slices, row = [], 0
        for w in work:
            seq = w.seq
            if w.prefill:
                start = seq.num_cached
                toks = tuple(seq.tokens[start : start + w.prefill])
                last = start + w.prefill == seq.prompt_len  # (never, where the last token decodes)
                sl = SeqSlice(seq.id, PREFILL, start, len(toks), row, toks, (len(toks) - 1,) if last else ())
            elif proposals is not None:
                toks = (seq.tokens[-1], *proposals[seq.id])
                sl = SeqSlice(seq.id, VERIFY, len(seq.tokens) - 1, len(toks), row, tuple(toks),
                              tuple(range(len(toks))))
            else:
                start = len(seq.tokens) - 1 + ahead
                sl = SeqSlice(seq.id, DECODE, start, 1, row, (PENDING if ahead else seq.tokens[-1],), (0,))
            slices.append(sl)
            row += sl.count
        return StepPlan(index, TARGET, tuple(slices))

    def draft_len(self, seq: Sequence) -> int:
        """Draft proposals this round: k, or fewer near max_tokens."""
        return min(self.spec_k, seq.request.max_tokens - seq.num_generated)

    def draft_plan(self, index: int, seqs: list[Sequence], j: int, last: dict[str, int]) -> StepPlan:
        """Draft step j of a round: at j = 0 each sequence feeds what its draft cache lacks;
        later one row each, the previous proposal (`last`, PENDING while on the device)."""
        slices, row = [], 0
        for s in seqs:
            if j == 0:
                start, toks = s.draft_cached, tuple(s.tokens[s.draft_cached :])
            else:
                start, toks = len(s.tokens) + j - 1, (last[s.id],)
            slices.append(SeqSlice(s.id, DRAFT, start, len(toks), row, toks, (len(toks) - 1,)))
            row += len(toks)
        return StepPlan(index, DRAFT_MODEL, tuple(slices))

    # -- commits: what a step computed ------------------------------------------------------
    def computed(self, plan: StepPlan) -> None:
        """Positions a step wrote into its model's cache (all phases but verify, whose kept
        rows are known only after acceptance: see accepted)."""
        for sl in plan.slices:
            seq = self.by_id[sl.request_id]
            if sl.phase == DRAFT:
                seq.draft_cached = sl.start + sl.count
            elif sl.phase == PREFILL:
                seq.num_cached = sl.start + sl.count
                self.blocks.register_prefix(seq.id, seq.tokens, seq.num_cached)
            elif sl.phase == DECODE:
                seq.num_cached = sl.start + 1
                if seq.num_cached == seq.prompt_len:  # it fed the prompt's last token (mlx-lm layout)
                    self.blocks.register_prefix(seq.id, seq.tokens, seq.num_cached)

    def accepted(self, seq: Sequence, n_proposed: int, n_accepted: int) -> None:
        """A verify kept its first n_accepted of n_proposed proposals: rows past them are
        rolled back (overwritten later), in both caches. Call before the tokens are appended."""
        seq.proposed += n_proposed
        seq.accepted += n_accepted
        n = len(seq.tokens)
        seq.num_cached = n + n_accepted
        seq.draft_cached = min(seq.draft_cached, n + n_accepted)
        if n == seq.prompt_len:  # this verify computed the prompt's last token
            self.blocks.register_prefix(seq.id, seq.tokens, n)

    def append_token(self, seq: Sequence, token, topk_ids, topk_logits) -> None:
        """A committed token and its recorded top-k; the request finishes when it is due."""
        seq.tokens.append(int(token))
        seq.topk_ids.append(topk_ids)
        seq.topk_logits.append(topk_logits)
        self.may_finish(seq, token)

    def may_finish(self, seq: Sequence, token) -> bool:
        """Mark seq finished if its last token (`token`) ends it: a stop id, or max_tokens
        reached. Its blocks stay held until `finish`."""
        if token in self.stop_ids:
            seq.finished, seq.finish_reason = True, "eos"
        elif seq.num_generated >= seq.request.max_tokens:
            seq.finished, seq.finish_reason = True, "length"
        return seq.finished

    def finish(self, seq: Sequence) -> None:
        """A finished request leaves the running set and gives its blocks back."""
        self.running.remove(seq)
        self.blocks.free(seq.id)
        if self.draft_blocks is not None:
            self.draft_blocks.free(seq.id)

    def may_cancel(self, request_id: str, reason: str) -> Sequence | None:
        """Between steps: end a request that has not finished (a waiting one leaves the
        queue, a running one its blocks), `reason` its finish reason. None when there is
        no such request (unknown, or finished already)."""
        seq = self.by_id.get(request_id)
        if seq is None or seq.finished:
            return None
        if seq in self.running:
            self.finish(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.finished, seq.finish_reason = True, reason
        return seq

    def forget(self, request_id: str) -> None:
        """Drop a finished request's state (a server runs for days: it keeps no finished
        request's records)."""
        seq = self.by_id.get(request_id)
        if seq is not None and seq.finished:
            del self.by_id[request_id]


def admit_recorded(blocks: BlockManager, request, reserve: int, first_start: int, *, prefix: bool) -> int:
    """Replay's admission: give a request its blocks as the recording did. A recorded run
    that started past position 0 found its prefix in the cache, and so does the replay
    (same plans, same order). Returns the matched prefix length."""
    matched = 0
    if first_start and prefix:
        # at most what the recording found: a forced replay (relayout) may have cached more
        matched = blocks.match_prefix(request.id, request.prompt_tokens[: first_start + 1])
        if matched != first_start:
            raise ValueError(f"replay of {request.id!r}: prefix cache holds {matched} tokens, the recording had "
                             f"{first_start}")
    blocks.allocate(request.id, reserve)
    return matched


def phases(seqs: list[Sequence], schedule: str, sequence) -> list[tuple[list[Sequence], str]]:
    """The (sequences, base schedule) phases a schedule runs. warm: the cache is first
    filled by other requests (the same prompts, one token each, batched), then the
    requests run serially on top of it: "cold vs warm" as one more schedule.
    sequence: makes the Sequence of a warm-up Request (the run's prefill layout)."""
    if schedule != WARM:
        return [(seqs, schedule)]
    warm = [sequence(Request(WARMUP_PREFIX + q.id, q.request.prompt_tokens, max_tokens=1)) for q in seqs]
    return [(warm, CONCURRENT), (seqs, SERIAL)]


def blocks_needed(seqs: list[Sequence], block_size: int, extra: int, *, copies: int = 1) -> int:
    """KV blocks for every sequence's prompt, its max_tokens and `extra` speculative rows;
    `copies` times (warm holds its warm-up copies too)."""
    need = sum(-(-(s.prompt_len + s.request.max_tokens + extra) // block_size) for s in seqs)
    return max(copies * need, 1)
