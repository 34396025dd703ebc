"""Turning logits into tokens, independently of what else is in the batch.

Greedy is mlx-lm's own rule (argmax of logits - logsumexp, in the model dtype,
one row at a time), so near-ties break exactly as mlx-lm breaks them. Sampling
draws its uniform number from a generator keyed by (seed, position, purpose):
a request's samples never depend on its batch, its step, or call order.
"""
from __future__ import annotations

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
