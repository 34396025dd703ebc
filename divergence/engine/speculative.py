"""Speculative decoding: acceptance rules for k draft proposals verified in k+1 rows.

Greedy: accept proposals while they equal the target's argmax; the target's
token at the first mismatch (or the bonus token after k accepts) follows.
Sampling: the standard rejection rule (accept d with min(1, p(d)/q(d)), else
draw from the normalised residual max(p - q, 0)), with uniforms keyed by
(seed, position), so accepted tokens follow the target's distribution exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

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
    proposal: Proposal, target_logits: np.ndarray, sampling: Sampling, first_position: int
) -> tuple[int, list[int]]:
    """Rejection sampling. target_logits: [k+1, vocab] float32; first_position is d_1's position."""
    out: list[int] = []
    for j, d in enumerate(proposal.tokens):
        pos = first_position + j
        p = smp.probs(target_logits[j], sampling)
        q = proposal.q[j]
        if smp.uniform(sampling, pos, smp.PURPOSE_ACCEPT) < min(1.0, p[d] / max(q[d], 1e-30)):
            out.append(int(d))
            continue
        residual = np.maximum(p - q, 0.0)
        if residual.sum() <= 0:  # p == q: any draw from p is exact
            residual = p
        out.append(smp.draw(residual / residual.sum(), smp.uniform(sampling, pos, smp.PURPOSE_RESIDUAL)))
        return j, out
    k = len(proposal.tokens)
    pos = first_position + k
    p = smp.probs(target_logits[k], sampling)
    out.append(smp.draw(p, smp.uniform(sampling, pos, smp.PURPOSE_SAMPLE)))
    return k, out
