"""KV writes as events: per-position hashes of the exact bytes a step stored, and the
writes a prefix hit inherits from the request that computed the shared blocks.

Public: `kv_writes` is also what the mlx-lm adapter (divergence.workloads.mlxlm_batch) uses,
so its traces hash K/V exactly as the engine's do.
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..core.events import TARGET, KvWrite, StepKvWrites, StepPlan
from ..core.hashing import hash_byte_rows


@dataclass
class StepKv:
    """A step's written K and V, [layers, T, kv_heads, head_dim] (lazy): built with the step's
    graph and evaluated with it, so reading them later starts no new work (a new op would
    queue behind the next step, already in flight). A position's hash is of its row's bytes,
    all kv heads; they are read through the arrays' buffers, so the graph needs no ops of
    its own for them."""

    k: mx.array
    v: mx.array
    layers: int

    @classmethod
    def of(cls, k: mx.array, v: mx.array) -> "StepKv":
        """k, v: [layers, T, kv_heads, head_dim] in slice order."""
        return cls(k, v, k.shape[0])

    def arrays(self) -> list[mx.array]:
        return [self.k, self.v]

    @property
    def rows(self) -> int:
        """Positions written (T)."""
        return self.k.shape[1] if self.k.ndim > 1 else 0

    def hashes(self) -> tuple[np.ndarray, np.ndarray]:
        """uint64 [layers, T] hashes of every position's exact K and V bytes (all kv heads)."""
        return tuple(hash_byte_rows(_flat(r)).reshape(r.shape[:2]) for r in self._rows())

    def hashes_in(self, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """uint64 [len(order)]: the hashes of rows `order` of K and of V (row l * T + t:
        layer l, position t), in that order."""
        return tuple(hash_byte_rows(_flat(r)[order]) for r in self._rows())

    def decode_hashes(self) -> tuple[np.ndarray, np.ndarray]:
        """hashes_in of a decode step's write order (request, then layer): the [T, layers]
        rows, copied in that order (a few KB) and hashed."""
        return tuple(hash_byte_rows(_flat(r.transpose(1, 0, 2))) for r in self._rows())

    def _rows(self) -> tuple[np.ndarray, np.ndarray]:
        return _byte_rows(self.k), _byte_rows(self.v)


def _byte_rows(a: mx.array) -> np.ndarray:
    """uint8 [layers, T, one row's bytes] of a [layers, T, ...] array: a view of its own buffer
    where it is C-contiguous (no copy), else a numpy copy of its uint view. K and V each at
    their own width (a model's values may be narrower than its keys)."""
    layers, T = a.shape[0], a.shape[1] if a.ndim > 1 else 0
    if not layers * T or not a.size:
        return np.zeros((layers, T, 0), np.uint8)
    m = memoryview(a)
    flat = np.frombuffer(m.cast("B"), np.uint8) if m.c_contiguous else np.array(_row_words(a)).view(np.uint8)
    return flat.reshape(layers, T, -1)


def _flat(rows: np.ndarray) -> np.ndarray:
    """[a, b, bytes] -> [a * b, bytes] (a copy where the axes were swapped)."""
    return rows.reshape(rows.shape[0] * rows.shape[1], rows.shape[2])


def _row_words(a: mx.array) -> mx.array:
    width = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[a.dtype.size]
    return a.reshape(a.shape[0] * a.shape[1], -1).view(width)


def kv_hashes(k: mx.array, v: mx.array) -> tuple[np.ndarray, np.ndarray]:
    """uint64 [layers, T] hashes of every position's exact K and V bytes (all kv heads),
    for a whole step in one call; k, v: [layers, T, kv_heads, head_dim]."""
    return StepKv.of(k, v).hashes()


def kv_writes(plan: StepPlan, model: str, k, v=None) -> StepKvWrites:
    """The step's KV writes, one per (slice, layer), with per-position hashes of the
    exact stored bytes; k, v: [layers, T, kv_heads, head_dim] in slice order (or k a StepKv).

    The rows are hashed in the order of the writes (slice, then layer, then position), so
    each write's hashes are the next `count` of one array: the writes as columns, their
    KvWrite events made only when read (core/events.py StepKvWrites)."""
    kv = k if isinstance(k, StepKv) else StepKv.of(k, v)
    layers, T = kv.layers, kv.rows
    sl = plan.slices
    if len(sl) == T and all(s.count == 1 and s.row_offset == i for i, s in enumerate(sl)):  # decode
        kh, vh = kv.decode_hashes()
    else:
        rows = np.arange(layers * T, dtype=np.int64).reshape(layers, T)
        parts = [rows[:, s.row_offset:s.row_offset + s.count].ravel() for s in sl]
        kh, vh = kv.hashes_in(np.concatenate(parts) if parts else np.zeros(0, np.int64))
    return StepKvWrites(plan.index, model, sl, layers, kh, vh)


class KvLog:
    """Which step wrote each (layer, position) of each request, and its hashes: what a
    prefix hit reads was written by another request, in another step."""

    def __init__(self, layers: int):
        self.layers = layers
        self._log: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def record(self, writes: list[KvWrite]) -> None:
        for w in writes:
            step, kh, vh = self._room(w.request_id, w.start + w.count)
            sl = slice(w.start, w.start + w.count)
            step[w.layer, sl], kh[w.layer, sl], vh[w.layer, sl] = w.step, w.k_hashes, w.v_hashes

    def _room(self, rid: str, length: int):
        cur = self._log.get(rid)
        if cur is None or cur[0].shape[1] < length:
            cap = max(length, 2 * (cur[0].shape[1] if cur else 0), 64)
            new = (np.full((self.layers, cap), -1, np.int64), np.zeros((self.layers, cap), np.uint64),
                   np.zeros((self.layers, cap), np.uint64))
            if cur is not None:
                n = cur[0].shape[1]
                for a, b in zip(new, cur):
                    a[:, :n] = b
            self._log[rid] = cur = new
        return cur

    def shared(self, request_id: str, sources: list[tuple[str, int]], block_size: int) -> list[KvWrite]:
        """The writes a request inherits: sources[i] = (owner, first position) of the block that
        holds its positions [i*bs, (i+1)*bs). One KvWrite per layer and run of positions that
        one step wrote (as arrays, not one event per position)."""
        if not sources:
            return []
        cols = [self._log[owner] for owner, _ in sources]
        idx = [np.arange(p0, p0 + block_size) for _, p0 in sources]
        step = np.concatenate([c[0][:, i] for c, i in zip(cols, idx)], axis=1)
        kh = np.concatenate([c[1][:, i] for c, i in zip(cols, idx)], axis=1)
        vh = np.concatenate([c[2][:, i] for c, i in zip(cols, idx)], axis=1)
        assert (step >= 0).all(), "a shared block holds positions no step recorded"
        out = []
        for layer in range(self.layers):
            s = step[layer]
            cuts = np.flatnonzero(np.diff(s)) + 1
            for a, b in zip(np.r_[0, cuts], np.r_[cuts, len(s)]):
                out.append(KvWrite(int(s[a]), TARGET, request_id, layer, int(a), int(b - a), kh[layer, a:b].copy(),
                                   vh[layer, a:b].copy()))
        return out
