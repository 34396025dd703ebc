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
    """How many draft tokens a round proposes (0..k_max), chosen each round for the most
    expected tokens per second of the batch, as serving engines turn speculation down when
    it does not pay (vLLM's disable-by-batch-size, dynamic speculation lengths).

    Expected tokens of a sequence at k proposals: 1 + a + ... + a^k, a its acceptance so far
    (accepted / proposed, pulled toward the batch's by `weight` proposals). A round's time at
    k: the moving average of the rounds run at k, or a line through the averages of the k's
    measured (before any: `prior_ratio`, a draft step's time over a verify's). Every
    `explore_every` rounds a neighbouring k runs twice (the first catches the draft cache up
    after rounds without drafts, the second is measured), so the estimates follow the load.

    Greedy requests keep the target's tokens at any k (the verify decides); what changes is
    the trace's schedule, recorded as any other. Timing decides, so two servers fed the same
    traffic may choose differently: a live trace is of the traffic as it ran."""

    def __init__(self, k_max: int, *, prior_accept: float = 0.6, weight: float = 8.0, alpha: float = 0.2,
                 prior_ratio: float = 0.5, explore_every: int = 32):
        self.k_max = k_max
        self.prior_accept, self.weight, self.alpha = prior_accept, weight, alpha
        self.prior_ratio, self.explore_every = prior_ratio, explore_every
        self.seconds: dict[int, float] = {}  # k -> moving average of a round's seconds
        self.proposed = self.accepted = 0.0  # every sequence's, decayed
        self._seen: dict[str, tuple[int, int, int]] = {}  # seq id -> (proposed, accepted, round) last read
        self.rounds = 0
        self.last = k_max
        self.chosen: dict[int, int] = {}  # k -> rounds run at it (for reports)

    # -- the round's choice ----------------------------------------------------------------
    def choose(self, seqs, caps: dict[str, int]) -> int:
        """k for this round. seqs: the decoding Sequences (their proposed / accepted counts);
        caps: the most each may propose (fewer near max_tokens)."""
        self._read(seqs)
        top = max(caps.values(), default=0)
        if top == 0:
            return 0
        g = (self.accepted + self.prior_accept * self.weight) / (self.proposed + self.weight)
        acc = [min((s.accepted + g * self.weight) / (s.proposed + self.weight), 0.999) for s in seqs]
        score = {k: sum(_expected(a, min(k, caps[s.id])) for a, s in zip(acc, seqs)) / self._time(k)
                 for k in range(top + 1)}
        best = max(score, key=lambda k: (score[k], k))
        self.rounds += 1
        if self.seconds and self.rounds % self.explore_every >= self.explore_every - 2:  # refresh a neighbour
            nb = best + 1 if (self.rounds // self.explore_every) % 2 else best - 1
            if 0 <= nb <= top:
                best = nb
        self.last = best
        self.chosen[best] = self.chosen.get(best, 0) + 1
        return best

    def observe(self, k: int, seconds: float) -> None:
        """A round at k took `seconds` (its steps launched to its verify collected)."""
        old = self.seconds.get(k)
        self.seconds[k] = seconds if old is None else old + self.alpha * (seconds - old)

    def _read(self, seqs) -> None:
        decay = 1.0 - self.alpha / 4
        self.proposed *= decay
        self.accepted *= decay
        for s in seqs:
            p, a, _ = self._seen.get(s.id, (0, 0, 0))
            self.proposed += s.proposed - p
            self.accepted += s.accepted - a
            self._seen[s.id] = (s.proposed, s.accepted, self.rounds)
        if len(self._seen) > 4 * len(seqs) + 64:  # finished sequences: forget them
            self._seen = {i: v for i, v in self._seen.items() if v[2] >= self.rounds - 1}

    def _time(self, k: int) -> float:
        if k in self.seconds:
            return self.seconds[k]
        pts = sorted(self.seconds.items())
        if len(pts) >= 2:  # least squares through the measured k's
            n = len(pts)
            mk = sum(x for x, _ in pts) / n
            mt = sum(t for _, t in pts) / n
            var = sum((x - mk) ** 2 for x, _ in pts)
            slope = max(sum((x - mk) * (t - mt) for x, t in pts) / var, 0.0)
            return max(mt + slope * (k - mk), 1e-9)
        if pts:  # one k measured: t = verify (1 + ratio k)
            k0, t0 = pts[0]
            verify = t0 / (1 + self.prior_ratio * k0)
            return verify * (1 + self.prior_ratio * k)
        return 1 + self.prior_ratio * k

    def describe(self) -> dict:
        return {"k_max": self.k_max, "rounds_at_k": dict(sorted(self.chosen.items())),
                "round_seconds_at_k": {k: round(v, 6) for k, v in sorted(self.seconds.items())}}


def _expected(a: float, k: int) -> float:
    """Tokens a round commits at k proposals, each accepted with probability a (in a row)."""
    return (1 - a ** (k + 1)) / (1 - a)
