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
