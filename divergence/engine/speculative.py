"""Speculative decoding: acceptance rules for k draft proposals verified in k+1 rows.

Greedy: accept proposals while they equal the target's argmax; the target's
token at the first mismatch (or the bonus token after k accepts) follows.
Sampling: the standard rejection rule (accept d with min(1, p(d)/q(d)), else
draw from the normalised residual max(p - q, 0)), with uniforms keyed by
(seed, position), so accepted tokens follow the target's distribution exactly.
Every draw can be recorded (`draws`), and replay can hand back the recorded
uniforms (`uniform`), so a replayed verify decides exactly as the recording did.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import sampling as smp
from ..core.request import Sampling
from ..errors import ModelLoadError


@dataclass
class Proposal:
    tokens: list[int]  # d_1..d_k
    q: list[np.ndarray | None]  # draft distributions that produced them (sampling only)


def accept_greedy(proposed: list[int], target_argmax: list[int]) -> tuple[int, list[int]]:
    """Returns (number accepted, tokens to commit) — accepted proposals + one target token."""
    j = 0
    while j < len(proposed) and proposed[j] == target_argmax[j]:
        j += 1
    return j, list(proposed[:j]) + [int(target_argmax[j])]


def accept_sampled(
    proposal: Proposal, target_logits: np.ndarray, sampling: Sampling, first_position: int, *,
    draws: list | None = None, uniform: Callable[[int, int], float] | None = None,
) -> tuple[int, list[int]]:
    """Rejection sampling. target_logits: [k+1, vocab] float32; first_position is d_1's position.
    draws: gets (position, smp.Draw) for every uniform drawn. uniform(position, purpose):
    where the uniforms come from (default: the request's keyed generator)."""
    u = uniform or (lambda pos, purpose: smp.uniform(sampling, pos, purpose))
    out: list[int] = []
    for j, d in enumerate(proposal.tokens):
        pos = first_position + j
        p = smp.probs(target_logits[j], sampling)
        q = proposal.q[j]
        if q.shape[0] < p.shape[0]:  # a draft head narrower than the target's: q is 0 past it
            q = np.pad(q, (0, p.shape[0] - q.shape[0]))
        ok, rec = smp.accept_traced(u(pos, smp.PURPOSE_ACCEPT), p[d], q[d], d)
        if draws is not None:
            draws.append((pos, rec))
        if ok:
            out.append(int(d))
            continue
        residual = np.maximum(p - q, 0.0)
        if residual.sum() <= 0:  # p == q: any draw from p is exact
            residual = p
        tok, rec = smp.draw_traced(residual / residual.sum(), u(pos, smp.PURPOSE_RESIDUAL), smp.PURPOSE_RESIDUAL)
        if draws is not None:
            draws.append((pos, rec))
        out.append(tok)
        return j, out
    k = len(proposal.tokens)
    pos = first_position + k
    p = smp.probs(target_logits[k], sampling)
    tok, rec = smp.draw_traced(p, u(pos, smp.PURPOSE_SAMPLE), smp.PURPOSE_SAMPLE)
    if draws is not None:
        draws.append((pos, rec))
    out.append(tok)
    return k, out


def draft_width(target, draft, target_ids: int, draft_ids: int) -> int:
    """The logit columns the draft proposes from: its head and the target's, cut to the
    narrower one. A draft must share the target's tokenizer (every token the same id) and
    its head must cover every token; heads may differ in padding past the tokenizer's
    tokens (Qwen2.5 0.5B: 151,936 rows, 7B: 152,064), ids no text encodes to.
    target, draft: LoadedModel; ModelLoadError, one line, for a draft that cannot serve."""
    if target.tokenizer_hash != draft.tokenizer_hash:
        vt, vd = _vocab(target), _vocab(draft)
        if vt != vd:
            moved = sum(1 for t, i in vt.items() if vd.get(t) != i) + sum(1 for t in vd if t not in vt)
            raise ModelLoadError(f"the draft {draft.path} has another tokenizer than the target {target.path} "
                                 f"({moved} of {max(len(vt), len(vd))} tokens differ): a draft must share the "
                                 f"target's tokenizer")
    tokens = len(_vocab(target))
    for what, m, ids in (("draft", draft, draft_ids), ("target", target, target_ids)):
        if ids < tokens:
            raise ModelLoadError(f"the {what} {m.path} has a vocabulary of {ids} ids and its tokenizer {tokens} "
                                 f"tokens: a draft must share the target's vocabulary")
    return min(target_ids, draft_ids)


def _vocab(loaded) -> dict:
    tok = loaded.tokenizer
    return dict(tok.get_vocab() if hasattr(tok, "get_vocab") else tok.vocab)


class AdaptiveDraft:
    """How many draft tokens a round proposes (0..k_max), learned from the tokens per second
    each length gives, as serving engines turn speculation down where it does not pay
    (vLLM's disable-by-batch-size, dynamic speculation lengths).

    An epoch is `epoch` rounds at one k; its rate is the tokens the decoding sequences gained
    over its wall time, so whatever a length costs counts: draft steps, the verify's rows,
    and the catching up of a draft cache after rounds without drafts. It is taken per
    sequence decoding (a small model's step hardly grows with its rows), so that epochs of
    two loads compare. (Learning it per batch size, as vLLM's disable-by-batch-size decides,
    was tried: split over batch sizes, a server's first minutes did not learn enough.) Each k is tried once,
    then the best rate's k runs (means, then moving averages, `alpha`), a neighbour every
    `explore_every`-th epoch so the rates follow the load. A pause between rounds (an idle
    server) counts as the round's own time only.

    `divergence serve --spec-adaptive` uses it (not by default: a user who serves a draft to
    trace speculative decoding should get speculative rounds). Greedy requests keep the
    target's tokens at any k (the verify decides); what changes is the trace's schedule,
    recorded as any other. Timing decides, so two servers fed the same
    traffic may choose differently: a live trace is of the traffic as it ran."""

    def __init__(self, k_max: int, *, epoch: int = 8, alpha: float = 0.3, explore_every: int = 6,
                 clock=time.perf_counter):
        self.k_max, self.epoch, self.alpha, self.explore_every = k_max, epoch, alpha, explore_every
        self.clock = clock
        self.rate: dict[int, float] = {}  # k -> moving average of tokens per second per sequence
        self._epochs_at: dict[int, int] = {}  # k -> epochs measured
        self.k = k_max  # this epoch's
        self.epochs = 0
        self._rounds = 0  # rounds of this epoch so far
        self._tokens = 0  # tokens gained this epoch
        self._seconds = 0.0  # its time
        self._batch = 0  # decoding sequences, summed over its rounds
        self._measured: dict[int, int] = {}  # k -> epochs measured
        self._last: float | None = None  # when the last round was chosen
        self._round_s = 0.0  # the last round's own time (observe)
        self._seen: dict[str, tuple[int, int]] = {}  # seq id -> (tokens, epoch) last read
        self.chosen: dict[int, int] = {}  # k -> rounds run at it (for reports)

    def choose(self, seqs, caps: dict[str, int]) -> int:
        """k for this round. seqs: the decoding Sequences (their tokens so far); caps: the most
        each may propose (fewer near max_tokens)."""
        now = self.clock()
        if self._last is not None:
            gap = now - self._last
            self._seconds += gap if gap <= max(0.5, 10 * self._round_s) else self._round_s
        self._last = now
        self._batch += len(seqs)
        for s in seqs:
            n, _ = self._seen.get(s.id, (None, 0))
            if n is not None:
                self._tokens += len(s.tokens) - n
            self._seen[s.id] = (len(s.tokens), self.epochs)
        if self._rounds >= self.epoch:
            self._close_epoch()
        self._rounds += 1
        k = min(self.k, max(caps.values(), default=0))
        self.chosen[k] = self.chosen.get(k, 0) + 1
        return k

    def next_k(self) -> int | None:
        """The next round's k, where it is known now (None: the next choose closes an epoch)."""
        return None if self._rounds >= self.epoch else self.k

    def observe(self, k: int, seconds: float) -> None:
        """A round took `seconds` (its steps launched to its verify collected)."""
        self._round_s = seconds

    def _close_epoch(self) -> None:
        if self._seconds > 0 and self._tokens > 0:
            r = self._tokens / self._seconds / (self._batch / self._rounds)  # per sequence decoding
            n = self._epochs_at[self.k] = self._epochs_at.get(self.k, 0) + 1
            old = self.rate.get(self.k, r)
            self.rate[self.k] = old + max(self.alpha, 1 / n) * (r - old)  # a mean at first, then moving
        self.epochs += 1
        self._rounds, self._tokens, self._seconds, self._batch = 0, 0, 0.0, 0
        self._seen = {i: v for i, v in self._seen.items() if v[1] >= self.epochs - 1}  # finished ones go
        untried = [k for k in range(self.k_max, -1, -1) if k not in self.rate]
        if untried:
            self.k = untried[0]
            return
        best = max(self.rate, key=lambda k: (self.rate[k], -k))
        if self.epochs % self.explore_every == 0:
            nb = [k for k in (best - 1, best + 1) if 0 <= k <= self.k_max]
            best = nb[(self.epochs // self.explore_every) % len(nb)]
        self.k = best

    def describe(self) -> dict:
        return {"k_max": self.k_max, "rounds_at_k": dict(sorted(self.chosen.items())),
                "tokens_per_s_per_sequence_at_k": {k: round(v, 1) for k, v in sorted(self.rate.items())}}
