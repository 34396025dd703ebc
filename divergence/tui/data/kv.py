"""One request's live KV writes as a layer x position grid, A against B."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...trace.reader import Trace


@dataclass
class KvGrid:
    """Live KV writes of one request, layer x position, as read at the given steps."""

    request_id: str
    prompt_len: int
    layers: np.ndarray  # layer numbers [L]
    positions: np.ndarray  # position numbers [P] (0..max)
    at_steps: tuple  # (A step, B step): None = the end of the run
    step: np.ndarray  # int64 [2, L, P]: step that wrote the live value (-1: none)
    k_hash: np.ndarray  # uint64 [2, L, P]
    v_hash: np.ndarray  # uint64 [2, L, P]
    differs: np.ndarray  # bool [L, P]: written on both sides, hashes differ
    one_sided: np.ndarray  # bool [L, P]: written on one side only
    earliest: tuple[int, int] | None  # (layer row, position) of the earliest differing cell
    two: bool

    @property
    def num_differ(self) -> int:
        return int(self.differs.sum())


def kv_grid(traces: list[Trace], request_id: str, prompt_len: int, at_steps: tuple = (None, None)) -> KvGrid:
    """The target model's live KV of the request in one trace or a pair, read at at_steps (per side)."""
    two = len(traces) == 2
    lives = []
    for s, t in enumerate(traces):
        try:
            lives.append(t.live_kv(request_id, model="target", at_step=at_steps[s]))
        except KeyError:  # the request is not in this trace
            lives.append({k: np.zeros(0, np.int64) for k in ("layer", "position", "step", "k_hash", "v_hash")})
    layers = np.unique(np.concatenate([np.asarray(lv["layer"], np.int64) for lv in lives]))
    top = max((int(np.max(lv["position"])) for lv in lives if len(lv["position"])), default=-1)
    positions = np.arange(top + 1)
    L, P, S = len(layers), len(positions), 2
    step = np.full((S, L, P), -1, np.int64)
    kh = np.zeros((S, L, P), np.uint64)
    vh = np.zeros((S, L, P), np.uint64)
    for s, lv in enumerate(lives):
        li = np.searchsorted(layers, np.asarray(lv["layer"], np.int64))
        p = np.asarray(lv["position"], np.int64)
        step[s, li, p] = lv["step"]
        kh[s, li, p] = lv["k_hash"]
        vh[s, li, p] = lv["v_hash"]
    if two:
        w0, w1 = step[0] >= 0, step[1] >= 0
        differs = w0 & w1 & ((kh[0] != kh[1]) | (vh[0] != vh[1]))
        one_sided = w0 ^ w1
    else:
        differs = one_sided = np.zeros((L, P), bool)
    earliest = None
    if differs.any():
        pos_any = np.flatnonzero(differs.any(axis=0))[0]
        earliest = (int(np.flatnonzero(differs[:, pos_any])[0]), int(pos_any))
    return KvGrid(request_id, prompt_len, layers, positions, tuple(at_steps[:2]), step, kh, vh,
                  differs, one_sided, earliest, two)
