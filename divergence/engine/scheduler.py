"""Which sequences run in the next target step, and how many rows each gets.

Two policies over the same requests: `serial` runs one request at a time to
completion in arrival order; `concurrent` is continuous batching: running
requests' decode (or verify) rows first, then prefill chunks of new requests
packed into the same step up to a token budget. Admission reserves a request's
whole length in KV blocks, so nothing is ever preempted mid-run.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .kv_cache import BlockManager
from .sequence import Sequence

from ..core.names import BASE_SCHEDULES, CONCURRENT, SERIAL


@dataclass
class Work:
    """One sequence's share of a target step."""

    seq: Sequence
    prefill: int = 0  # prompt rows to prefill this step (0 = decode/verify)


class Scheduler:
    def __init__(self, seqs: list[Sequence], *, schedule: str, token_budget: int, blocks: BlockManager,
                 reserve_extra: int = 0):
        assert schedule in BASE_SCHEDULES
        self.schedule_name = schedule
        self.budget = token_budget
        self.blocks = blocks
        self.reserve_extra = reserve_extra  # spec-decoding overhang beyond max_tokens
        order = sorted(range(len(seqs)), key=lambda i: (seqs[i].request.arrival, i))
        self.waiting: deque[Sequence] = deque(seqs[i] for i in order)
        self.running: list[Sequence] = []

    def done(self) -> bool:
        return not self.waiting and not self.running

    def reserve_len(self, seq: Sequence) -> int:
        return seq.prompt_len + seq.request.max_tokens + self.reserve_extra

    def next_arrival(self) -> int | None:
        return self.waiting[0].request.arrival if self.waiting else None

    def _admit(self, clock: int, admitted: list[Sequence]) -> None:
        while self.waiting:
            seq = self.waiting[0]
            if self.schedule_name == CONCURRENT and seq.request.arrival > clock:
                return
            if self.schedule_name == SERIAL and self.running:
                return
            matched = self.blocks.match_prefix(seq.id, seq.request.prompt_tokens)
            if not self.blocks.can_allocate(seq.id, self.reserve_len(seq)):
                self.blocks.free(seq.id)  # undo the prefix match; wait for memory
                if not self.running:
                    raise RuntimeError(f"request {seq.id!r} needs more KV blocks than the cache has")
                return
            self.blocks.allocate(seq.id, self.reserve_len(seq))
            seq.num_cached = matched
            self.waiting.popleft()
            self.running.append(seq)
            admitted.append(seq)

    def schedule(self, clock: int, *, decode_rows: int = 1) -> tuple[list[Work], list[Sequence]]:
        """Plan the next target step. Returns (work, newly admitted sequences)."""
        admitted: list[Sequence] = []
        self._admit(clock, admitted)
        work: list[Work] = []
        budget = self.budget
        for seq in self.running:  # decode / verify rows first: running requests never starve
            if not seq.in_prefill:
                work.append(Work(seq))
                budget -= decode_rows
        for seq in self.running:
            if seq.in_prefill and budget > 0:
                n = min(seq.prompt_len - seq.num_cached, budget)
                work.append(Work(seq, prefill=n))
                budget -= n
        return work, admitted

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.id)
