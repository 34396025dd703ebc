"""Turning logits into tokens, independently of what else is in the batch.

Greedy is mlx-lm's own rule (argmax of logits - logsumexp, in the model dtype,
one row at a time), so near-ties break exactly as mlx-lm breaks them. Sampling
draws its uniform number from a generator keyed by (seed, position, purpose):
a request's samples never depend on its batch, its step, or call order.
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..core.request import Sampling

PURPOSE_SAMPLE = 0
PURPOSE_ACCEPT = 1
PURPOSE_RESIDUAL = 2


def greedy_rows(logits: mx.array) -> mx.array:
    """argmax per row, computed row by row as mlx-lm's generate_step does."""
    out = []
    for i in range(logits.shape[0]):
        row = logits[i : i + 1]
        out.append(mx.argmax(row - mx.logsumexp(row, keepdims=True), axis=-1))
    return mx.concatenate(out) if out else mx.zeros((0,), dtype=mx.uint32)


def uniform(sampling: Sampling, position: int, purpose: int = PURPOSE_SAMPLE) -> float:
    return float(np.random.default_rng([sampling.seed & 0xFFFFFFFF, position, purpose]).random())


def probs(logits_row: np.ndarray, sampling: Sampling) -> np.ndarray:
    """Target distribution after temperature and top-p, float64."""
    z = logits_row.astype(np.float64) / max(sampling.temperature, 1e-8)
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    if sampling.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        csum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(csum, sampling.top_p)) + 1]
        mask = np.zeros_like(p)
        mask[keep] = p[keep]
        p = mask / mask.sum()
    return p


def draw(p: np.ndarray, u: float) -> int:
    """Inverse-CDF draw: the first token whose cumulative probability exceeds u."""
    c = np.cumsum(p)
    return int(min(np.searchsorted(c, u * c[-1], side="right"), len(p) - 1))


def topk(logits_f32: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k ids and logits per row, best first; ties broken by lower id."""
    k = min(k, logits_f32.shape[-1])
    part = np.argpartition(-logits_f32, k - 1, axis=-1)[:, :k]
    vals = np.take_along_axis(logits_f32, part, axis=-1)
    order = np.lexsort((part, -vals), axis=-1)
    ids = np.take_along_axis(part, order, axis=-1).astype(np.int32)
    return ids, np.take_along_axis(vals, order, axis=-1).astype(np.float32)


# -- what a draw decided, for the trace (the sampler's side of a diagnosis) ---------------

PURPOSE_DRAFT = 3  # the draft model's own proposal


@dataclass(frozen=True)
class Draw:
    """One uniform draw and what it decided. [lo, hi) is the range of u that gives this
    outcome: the token's slice of the cumulative distribution (in token-id order), or
    for an accept test [0, a) accepted / [a, 1) rejected, a = min(1, p/q). The
    neighbouring tokens' slices let a report say how far a distribution moved."""

    purpose: int
    value: float  # u in [0, 1)
    token: int  # the token drawn, or the proposal an accept test judged
    lo: float
    hi: float
    prev_token: int = -1  # the token just below in the CDF (nonzero probability), -1: none
    prev_lo: float = float("nan")  # its slice is [prev_lo, lo)
    next_token: int = -1  # the token just above
    next_hi: float = float("nan")  # its slice is [hi, next_hi)
    p: float = float("nan")  # accept: the target's p(token); else the drawn token's probability
    q: float = float("nan")  # accept: the draft's q(token)

    @property
    def accepted(self) -> bool:
        return self.purpose == PURPOSE_ACCEPT and self.value < min(1.0, self.p / max(self.q, 1e-30))

    def record(self, step: int, request_id: str, position: int) -> dict:
        """The columns of its row in the trace's draws table (Observer.on_record("draws", ...))."""
        from ..core.names import DRAW_PURPOSES

        return dict(step=step, request=request_id, position=position, purpose=DRAW_PURPOSES[self.purpose],
                    value=self.value, token=self.token, lo=self.lo, hi=self.hi, prev_token=self.prev_token,
                    prev_lo=self.prev_lo, next_token=self.next_token, next_hi=self.next_hi, p=self.p, q=self.q)


def draw_traced(p: np.ndarray, u: float, purpose: int = PURPOSE_SAMPLE) -> tuple[int, Draw]:
    """`draw(p, u)` and the record of it."""
    tok = draw(p, u)
    c = np.cumsum(p)
    total = float(c[-1])
    lo = float(c[tok - 1]) / total if tok else 0.0
    hi = float(c[tok]) / total
    nz = np.flatnonzero(p > 0)
    i = int(np.searchsorted(nz, tok))
    prev_t = int(nz[i - 1]) if i > 0 else -1
    j = i + 1 if i < len(nz) and nz[i] == tok else i
    next_t = int(nz[j]) if j < len(nz) else -1
    prev_lo = (float(c[prev_t - 1]) / total if prev_t > 0 else 0.0) if prev_t >= 0 else float("nan")
    next_hi = float(c[next_t]) / total if next_t >= 0 else float("nan")
    return tok, Draw(purpose, float(u), tok, lo, hi, prev_t, prev_lo, next_t, next_hi, p=hi - lo)


def accept_traced(u: float, p_d: float, q_d: float, token: int) -> tuple[bool, Draw]:
    """The rejection test u < min(1, p/q) of a draft proposal, and the record of it."""
    a = min(1.0, float(p_d) / max(float(q_d), 1e-30))
    ok = u < a
    lo, hi = (0.0, a) if ok else (a, 1.0)
    return ok, Draw(PURPOSE_ACCEPT, float(u), int(token), lo, hi, p=float(p_d), q=float(q_d))


def token_stats(logits_row: np.ndarray, token: int, sampling: Sampling) -> tuple[float, float]:
    """The chosen token's own logit and its probability: under the request's sampler
    (temperature, top-p), or for greedy requests the plain softmax (what logprobs report)."""
    logit = float(np.float32(logits_row[token]))
    if sampling.greedy:
        z = logits_row.astype(np.float64)
        m = z.max()
        prob = float(np.exp(z[token] - m) / np.exp(z - m).sum())
    else:
        prob = float(probs(logits_row, sampling)[token])
    return logit, prob
