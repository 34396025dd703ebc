"""One request's live KV writes as a layer x position grid, A against B.

The cells and what counts as "differs" come from divergence.analysis.kv_grid, which
the HTML page uses too: both count the cells the divergent step read the same way."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...analysis.kv_grid import KvCells, live_cells
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
    cells: KvCells | None = None
    read_before: int | None = None  # at the divergent step: the divergent position (it read positions < it)

    @property
    def num_differ(self) -> int:
        return int(self.differs.sum())

    def read_count(self) -> tuple[int, int]:
        """(cells that differ, cells both sides hold): at the divergent step, of the positions it read
        (the count the HTML page shows); otherwise of the whole grid."""
        if self.cells is None:
            return self.num_differ, int((self.step >= 0).all(axis=0).sum())
        return self.cells.read_count(self.read_before)


def kv_grid(traces: list[Trace], request_id: str, prompt_len: int, at_steps: tuple = (None, None),
            read_before: int | None = None) -> KvGrid:
    """The target model's live KV of the request in one trace or a pair, read at at_steps (per side).
    read_before: the position whose computation read this cache (counts cover positions < it)."""
    c = live_cells(traces, request_id, at_steps)
    L, P = c.step.shape[1:]
    step = np.full((2, L, P), -1, np.int64)
    kh = np.zeros((2, L, P), np.uint64)
    vh = np.zeros((2, L, P), np.uint64)
    step[:len(traces)], kh[:len(traces)], vh[:len(traces)] = c.step, c.k_hash, c.v_hash
    return KvGrid(request_id, prompt_len, c.layers, np.arange(P), tuple(at_steps[:2]), step, kh, vh,
                  c.differs, c.one_sided, c.earliest(), c.two, c, read_before)
