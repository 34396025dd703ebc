"""Turning logits into tokens, independently of what else is in the batch.

Greedy is mlx-lm's own rule (argmax of logits - logsumexp, in the model dtype),
so near-ties break exactly as mlx-lm breaks them; it runs on the device for all
logit rows in one graph (bitwise the row-by-row result: tests/engine/
test_sampling.py). Only [rows] token ids, [rows, k] top-k ids and values and the
chosen token's logit go to the host; full logits only for rows that sample.

Sampling draws its uniform number from a generator keyed by (seed, position,
purpose): a request's samples never depend on its batch, its step, or call order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import mlx.core as mx
import numpy as np

from ..core.events import TokenEvent
from ..core.names import LOGITS, LOGPROBS
from ..core.request import Sampling

PURPOSE_SAMPLE = 0  # the token of a position (plain sampling, or the bonus token after k accepts)
PURPOSE_ACCEPT = 1  # the accept/reject test of a draft proposal
PURPOSE_RESIDUAL = 2  # the draw from the residual after a rejection
PURPOSE_DRAFT = 3  # the draft model's own proposal


@dataclass
class DeviceSample:
    """A step's sampling results, still on the device (lazy until evaluated)."""

    ids: mx.array  # [R] mlx-lm's greedy token per logit row
    # the k largest logits' ids (unordered), as device_topk gives them: ([R, k] ids,) or, from its
    # two stages, ([R, k] chunk ids, [R, k] picks), the host's to combine (`chunk`)
    top_cols: tuple | None
    top_vals: mx.array | None  # [R, k] their values, in the model dtype
    chosen: mx.array | None  # [R, 1] the logit of ids, in the model dtype
    full: mx.array | None  # [S, vocab] float32: the rows that sample with temperature
    full_rows: tuple[int, ...] = ()
    lse: mx.array | None = None  # [R] float32 logsumexp of each row (a greedy token's probability)
    # what the host needs of the above, as uint32 bits in one [R, 1 + (2 or 3) k + 2] array:
    # one copy to the host, not five (each one a wait on a GPU)
    packed: mx.array | None = None
    chunk: int = 0  # top_cols are topk's two stages' (chunk ids, picks) of this chunk size; 0: ids

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.packed if self.packed is not None else self.ids, self.full) if a is not None]


def _bits(a: mx.array) -> mx.array:
    """uint32 bit patterns of an array's values (16-bit floats in the low half), exact."""
    if a.dtype.size == 2:
        return a.view(mx.uint16).astype(mx.uint32)
    return a.view(mx.uint32) if a.dtype.size == 4 else a.astype(mx.uint32)


def _widen(bits: np.ndarray, dtype) -> np.ndarray:
    """The inverse of _bits on the host: float32 values, exact."""
    if dtype == mx.bfloat16:
        return (bits << 16).view(np.float32)
    if dtype == mx.float16:
        return bits.astype(np.uint16).view(np.float16).astype(np.float32)
    return bits.view(np.float32)


def sample_on_device(logits: mx.array, *, top_k: int, full_rows=(), want_topk: bool = True,
                     values: str = LOGITS) -> DeviceSample:
    """One graph for every logit row: greedy ids, top-k and the chosen logit; full fp32
    logits only for `full_rows` (rows whose request samples with temperature).
    values=LOGPROBS: top-k and chosen values are mlx-lm's log-probs (logits - logsumexp, in
    the model dtype), what traces of its BatchGenerator hold, so a replay compares bit for bit.
    Where compiled_sampler() says so, the graph is one mx.compile'd function, traced once per
    shape (the same bits: tests/engine/test_compiled_step.py)."""
    rows = logits.shape[0]
    if rows == 0:
        z = mx.zeros((0,), dtype=mx.uint32)
        return DeviceSample(z, None, None, None, None, ())
    k = min(top_k, logits.shape[-1])
    if compiled_sampler():
        out = _compiled(want_topk, k, values)(logits)
    else:
        out = _sample_graph(logits, want_topk, k, values)
    ids, top_cols, top_vals, chosen, lse, packed = out[0], None, None, None, None, None
    chunk = 0
    if want_topk:
        *top_cols, top_vals, chosen, lse, packed = out[1:]
        top_cols, chunk = tuple(top_cols), _topk_chunk(logits.shape[-1], k)
    full = None
    full_rows = tuple(full_rows)
    if full_rows:
        full = logits[mx.array(np.asarray(full_rows, dtype=np.int32))].astype(mx.float32)
    return DeviceSample(ids, top_cols, top_vals, chosen, full, full_rows, lse, packed, chunk)


def _sample_graph(logits: mx.array, want_topk: bool, k: int, values: str) -> tuple[mx.array, ...]:
    """(ids,) or (ids, *top-k id columns, top-k values, chosen, lse, packed) of sample_on_device."""
    # mlx-lm: logprobs = logits - logsumexp(logits); sampler = argmax (first index on ties)
    lse_model = mx.logsumexp(logits, axis=-1, keepdims=True)
    logprobs = logits - lse_model
    ids = mx.argmax(logprobs, axis=-1)
    if not want_topk:
        return (ids,)
    # values stay in the model dtype: the host widens them exactly (fewer device ops)
    src = logprobs if values == LOGPROBS else logits
    top_cols, top_vals, _ = device_topk(src, k)
    chosen = _take_rows(src, ids[:, None])
    # float32 logsumexp of the values, for the chosen token's probability (for fp32 logits
    # it is the one the greedy pick used)
    if src.dtype == mx.float32 and values != LOGPROBS:
        lse = lse_model[:, 0]
    else:
        lse = mx.logsumexp(src.astype(mx.float32), axis=-1)
    packed = mx.concatenate([ids[:, None].astype(mx.uint32), *top_cols, _bits(top_vals), _bits(chosen),
                             _bits(lse[:, None])], axis=1)
    return (ids, *top_cols, top_vals, chosen, lse, packed)


@lru_cache(maxsize=16)
def _compiled(want_topk: bool, k: int, values: str):
    return mx.compile(lambda logits: _sample_graph(logits, want_topk, k, values))


def compiled_sampler() -> bool:
    """Whether sample_on_device runs compiled: DIVERGENCE_COMPILED_STEP as for the forward's
    decode steps (model/compiled_step.py), by default on the CPU only (proved there; not yet
    on MLX CUDA)."""
    from .model.compiled_step import default_on

    return default_on(cuda=False)


CHUNK = 128  # vocabulary chunk of the two-stage top-k


def device_topk(src: mx.array, k: int) -> tuple[tuple, mx.array, int]:
    """The k largest values of each row of [R, vocab] `src` (unordered): (id columns, [R, k]
    values, chunk). Two stages: the k chunks of CHUNK ids with the largest maxima hold every
    value above the k-th largest, and enough equal to it (so the values are exact; which of
    the ids tied at the k-th value are kept is arbitrary, as with any partition), then a
    partition of those k * CHUNK. One pass over the vocabulary (a max) instead of a
    partition of it: on a large vocabulary, several times cheaper. The columns are then
    ([R, k] chunk ids, [R, k] picks among the k * CHUNK), id = chunk_ids[pick // CHUNK] *
    CHUNK + pick % CHUNK, made on the host (_unpack); with one stage ([R, k] ids,), chunk 0.

    On a GPU the values are read by flat gathers (_take_rows), not take_along_axis: on first
    use MLX CUDA compiles a kernel module per primitive and dtype pair, and take_along_axis's
    (GatherAxis, every rank and layout variant) made most of a fresh GPU machine's first run
    (bench/first_run.py; docs/performance.md), where a flat gather is a module the model
    needs anyway. A gather moves values: the same bits either way."""
    rows, vocab = src.shape
    if not _topk_chunk(vocab, k):
        ids = mx.argpartition(src, kth=vocab - k, axis=-1)[:, vocab - k :]
        return (ids,), _take_rows(src, ids), 0
    n = vocab // CHUNK
    best = mx.argpartition(src.reshape(rows, n, CHUNK).max(axis=-1), kth=n - k, axis=-1)[:, n - k :]
    cand = _take_rows(src, (best[:, :, None] * CHUNK + _chunk_offsets()).reshape(rows, k * CHUNK))
    pick = mx.argpartition(cand, kth=k * CHUNK - k, axis=-1)[:, k * CHUNK - k :]
    return (best, pick), _take_rows(cand, pick), CHUNK


def _topk_chunk(vocab: int, k: int) -> int:
    """The chunk of device_topk's two stages at this vocabulary and k; 0: one stage."""
    return 0 if vocab % CHUNK or vocab // CHUNK <= k else CHUNK


def _take_rows(a: mx.array, idx: mx.array) -> mx.array:
    """[R, j]: a[r, idx[r, i]] of [R, n] `a` (idx uint32). On a GPU one gather of `a`'s rows
    laid end to end, at idx plus each row's start (see device_topk); elsewhere, and where
    that many elements would overflow uint32 indices (2**32: over 28,000 rows of a
    151,936-word vocabulary), take_along_axis: the CPU compiles nothing, so there the flat
    form's two more graph nodes would be cost without gain. The same values either way."""
    rows, width = a.shape
    if rows * width >= 2**32 or not flat_gathers():
        return mx.take_along_axis(a, idx, axis=-1)
    return a.reshape(-1)[idx + _row_starts(rows, width)]


def flat_gathers() -> bool:
    """Whether _take_rows gathers flat: on a GPU (where take_along_axis is a module to compile)."""
    return mx.default_device().type == mx.DeviceType.gpu


@lru_cache(maxsize=32)
def _row_starts(rows: int, width: int) -> mx.array:
    """uint32 [rows, 1]: where each row of a [rows, width] array starts in its flat form (made
    once per shape: a constant, no op a step)."""
    a = mx.arange(rows, dtype=mx.uint32)[:, None] * width
    mx.eval(a)
    return a


@lru_cache(maxsize=1)
def _chunk_offsets() -> mx.array:
    a = mx.arange(CHUNK, dtype=mx.uint32)
    mx.eval(a)
    return a


@dataclass
class Sampled:
    """A step's sampling results on the host."""

    ids: np.ndarray  # [R] int64
    # [R, k] int32, best first, ties by lower id; when the k-th value is tied beyond k,
    # which of the tied ids are kept is the backend's partition's choice (fixed per row)
    top_ids: np.ndarray | None = None
    top_vals: np.ndarray | None = None  # [R, k] float32
    chosen: np.ndarray | None = None  # [R] float32
    full: dict[int, np.ndarray] = field(default_factory=dict)  # row -> float32 [vocab]
    lse: np.ndarray | None = None  # [R] float32 logsumexp per row

    def stats_of(self, row: int, token: int, sampling: Sampling | None) -> tuple[float, float]:
        """A token's (logit_of, probability): the probability under the request's sampler
        where the row samples, else the plain softmax (what logprobs report); NaN where the
        host cannot tell. One lookup of the logit for both (a committed token's event takes
        both, once per token: plain floats, not numpy scalars, on that hot path)."""
        logit = self.logit_of(row, token)
        if sampling is not None and not sampling.greedy and row in self.full:
            return logit, float(probs(self.full[row], sampling)[token])
        if self.lse is None or not math.isfinite(logit):
            return logit, float("nan")
        # float64 of both float32 values, their difference and numpy's exp of it: the bits
        # np.exp(np.float64(logit) - np.float64(lse)) gives (the same ufunc loop on one
        # float64), with no numpy scalars made on the way
        return logit, float(np.exp(logit - float(self.lse[row])))

    def logits(self, row: int) -> np.ndarray:
        """The full float32 logits of a row that samples."""
        return self.full[row]

    def rows(self, r0: int, r1: int) -> np.ndarray:
        return np.stack([self.full[r] for r in range(r0, r1)])

    def logit_of(self, row: int, token: int) -> float:
        """A token's own logit in a row (NaN where the host holds neither it nor the full row)."""
        if row in self.full:
            return float(self.full[row][token])
        if self.chosen is not None and int(self.ids[row]) == token:
            return float(self.chosen[row])
        hit = np.flatnonzero(self.top_ids[row] == token) if self.top_ids is not None else ()
        return float(self.top_vals[row][hit[0]]) if len(hit) else float("nan")


def to_host(ds: DeviceSample) -> Sampled:
    """Copy a (evaluated or not) DeviceSample to the host; sorts the small top-k there."""
    # with the top-k everything comes packed in one array; without it, only the ids
    if ds.packed is not None:
        out = _unpack(np.array(ds.packed), ds.top_vals.dtype, ds.chunk)
    else:
        out = Sampled(np.array(ds.ids).astype(np.int64))
    if ds.full is not None:
        full = np.array(ds.full)
        out.full = {r: full[i] for i, r in enumerate(ds.full_rows)}
    return out


def _unpack(p: np.ndarray, dtype, chunk: int) -> Sampled:
    """The packed [R, ids | id columns | values | chosen | lse] uint32 rows (sample_on_device)."""
    k = (p.shape[1] - 3) // (3 if chunk else 2)
    rows = np.arange(len(p))[:, None]  # (fancy indexing: take_along_axis costs more than the sort at [8, 8])
    if chunk:  # topk's two stages: id = chunk_ids[pick // chunk] * chunk + pick % chunk
        best, pick = p[:, 1 : 1 + k].astype(np.int64), p[:, 1 + k : 1 + 2 * k].astype(np.int64)
        part = (best[rows, pick // chunk] * chunk + pick % chunk).astype(np.int32)
    else:
        part = p[:, 1 : 1 + k].astype(np.int32)
    v = p.shape[1] - 2 - k  # the values' first column
    vals = _widen(p[:, v : v + k], dtype)
    order = np.lexsort((part, -vals), axis=-1)
    return Sampled(p[:, 0].astype(np.int64), part[rows, order], vals[rows, order], _widen(p[:, v + k], dtype),
                   lse=p[:, v + k + 1].view(np.float32))


def float32(a: mx.array) -> np.ndarray:
    """An MLX float array as numpy float32, exactly (bf16 widened through its bits)."""
    if a.dtype == mx.bfloat16:
        return (np.array(a.view(mx.uint16)).astype(np.uint32) << 16).view(np.float32)
    return np.array(a).astype(np.float32)


def choose(sampling: Sampling, sampled: Sampled, row: int, position: int, *, draws: list | None = None,
           u: float | None = None) -> int:
    """The token a request takes at `position` from logit row `row`: greedy or a keyed draw
    (`u`: the uniform to use instead, as replay hands back a recorded one). draws: gets
    (position, Draw) for the draw."""
    if sampling.greedy:
        return int(sampled.ids[row])
    tok, rec = draw_traced(probs(sampled.logits(row), sampling), uniform(sampling, position) if u is None else u)
    if draws is not None:
        draws.append((position, rec))
    return tok


def token_event(step: int, request_id: str, position: int, token: int, spec: int, sampled: Sampled,
                row: int, *, sampling: Sampling | None = None) -> TokenEvent:
    """The event of a committed token, with its logit row's top-k, its own logit and its
    probability (one place for engine and replay)."""
    token = int(token)
    logit, prob = sampled.stats_of(row, token, sampling)
    return TokenEvent(step, request_id, position, token, spec, sampled.top_ids[row], sampled.top_vals[row],
                      logit=logit, prob=prob)


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
    """Top-k ids and logits per row of host logits, best first; ties broken by lower id
    (for engines whose logits are already on the host, e.g. the mlx-lm adapter)."""
    k = min(k, logits_f32.shape[-1])
    part = np.argpartition(-logits_f32, k - 1, axis=-1)[:, :k]
    vals = np.take_along_axis(logits_f32, part, axis=-1)
    order = np.lexsort((part, -vals), axis=-1)
    ids = np.take_along_axis(part, order, axis=-1).astype(np.int32)
    return ids, np.take_along_axis(vals, order, axis=-1).astype(np.float32)


# -- what a draw decided, for the trace (the sampler's side of a diagnosis) ---------------

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
