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
