"""One request's live KV-cache writes in two traces, layer x position: which cells differ.

The one place that says what "the KV cache the divergent step read" is, so the
browser's KV screen and the HTML page's heat map count the same cells: the live
writes at the step that computed the first divergent token (per side), at the
positions before that token (what the row at position - 1 attended to, as bisect
compares them), where both traces hold a write. numpy only; reads traces through
their `live_kv` (no engine, no textual).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.names import TARGET


@dataclass
class KvCells:
    """Live KV writes of one request in one trace or a pair, layer x position."""

    layers: np.ndarray  # layer numbers [L]
    step: np.ndarray  # int64 [S, L, P]: the step whose write is live (-1: none)
    k_hash: np.ndarray  # uint64 [S, L, P]
    v_hash: np.ndarray  # uint64 [S, L, P]

    @property
    def two(self) -> bool:
        return self.step.shape[0] == 2

    @property
    def written(self) -> np.ndarray:
        """bool [S, L, P]."""
        return self.step >= 0

    @property
    def both(self) -> np.ndarray:
        """bool [L, P]: written on every side (the cells that can be compared)."""
        return self.written.all(axis=0)

    @property
    def differs(self) -> np.ndarray:
        """bool [L, P]: written on both sides, and the K or V hashes differ."""
        if not self.two:
            return np.zeros(self.step.shape[1:], bool)
        return self.both & ((self.k_hash[0] != self.k_hash[1]) | (self.v_hash[0] != self.v_hash[1]))

    @property
    def one_sided(self) -> np.ndarray:
        if not self.two:
            return np.zeros(self.step.shape[1:], bool)
        return self.written[0] ^ self.written[1]

    def earliest(self, before: int | None = None) -> tuple[int, int] | None:
        """(layer row, position) of the earliest differing cell: lowest position, then lowest layer
        (as bisect orders cells); only positions < before when given."""
        d = self.differs if before is None else self.differs[:, :before]
        if not d.any():
            return None
        p = int(np.flatnonzero(d.any(axis=0))[0])
        return int(np.flatnonzero(d[:, p])[0]), p

    def read_count(self, before: int | None) -> tuple[int, int]:
        """(cells that differ, cells both sides hold) at positions < before (all when None)."""
        both, differs = (self.both, self.differs) if before is None else \
            (self.both[:, :before], self.differs[:, :before])
        return int(differs.sum()), int(both.sum())


def live_cells(traces, request_id: str, at_steps=(None, None), *, model: str = TARGET,
               num_layers: int | None = None, positions: int | None = None) -> KvCells:
    """The request's KV writes live at at_steps (per side; None = the end of the run).

    Layers: 0..num_layers-1 when given, else the layers written. Positions: 0..positions-1
    when given (writes beyond are left out), else up to the highest written."""
    lives = []
    for s, t in enumerate(traces):
        try:
            lives.append(t.live_kv(request_id, model=model, at_step=at_steps[s]))
        except KeyError:  # the request is not in this trace
            lives.append({k: np.zeros(0, np.int64) for k in ("layer", "position", "step", "k_hash", "v_hash")})
    if num_layers:
        layers = np.arange(int(num_layers))
    else:
        layers = np.unique(np.concatenate([np.asarray(lv["layer"], np.int64) for lv in lives]))
    if positions is None:
        positions = 1 + max((int(np.max(lv["position"])) for lv in lives if len(lv["position"])), default=-1)
    S, L, P = len(traces), len(layers), int(positions)
    step = np.full((S, L, P), -1, np.int64)
    kh = np.zeros((S, L, P), np.uint64)
    vh = np.zeros((S, L, P), np.uint64)
    for s, lv in enumerate(lives):
        layer = np.asarray(lv["layer"], np.int64)
        p = np.asarray(lv["position"], np.int64)
        li = np.searchsorted(layers, layer)
        keep = (p < P) & (li < L)
        keep[keep] &= layers[li[keep]] == layer[keep]
        li, p = li[keep], p[keep]
        step[s, li, p] = np.asarray(lv["step"], np.int64)[keep]
        kh[s, li, p] = np.asarray(lv["k_hash"])[keep]
        vh[s, li, p] = np.asarray(lv["v_hash"])[keep]
    return KvCells(layers, step, kh, vh)


def divergent_read(a, b, request_id: str, position: int, step_a: int, step_b: int, *, model: str = TARGET,
                   num_layers: int | None = None) -> KvCells:
    """What the step that computed `position` read in each trace: the writes live at step_a / step_b
    at positions < position. read_count(None) of it is "N of M cells differ"."""
    return live_cells([a, b], request_id, (step_a, step_b), model=model, num_layers=num_layers,
                      positions=max(int(position), 0))
