"""One position's MoE routing, A against B: per layer the chosen experts, their exact
gate values, the runner-up, and whether the router saw the same input."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...trace.reader import Trace


@dataclass
class RoutingSide:
    step: int
    experts: list[int]  # in the order the block used them
    scores: list[float]
    runner_up: int
    runner_up_score: float
    input_hash: int


@dataclass
class LayerRoutingRow:
    layer: int
    sides: list[RoutingSide | None]  # one per trace (None: that trace has no row here)

    @property
    def flipped(self) -> bool:
        """Both sides present and their chosen expert sets differ."""
        s = self.sides
        return len(s) == 2 and None not in s and set(s[0].experts) != set(s[1].experts)

    @property
    def same_input(self) -> bool | None:
        s = self.sides
        if len(s) != 2 or None in s:
            return None
        return s[0].input_hash == s[1].input_hash


@dataclass
class PositionRouting:
    request_id: str
    position: int
    layers: list[LayerRoutingRow]


def request_routing(traces: list[Trace], request_id: str) -> list[dict] | None:
    """Each trace's routing rows of a request (all steps: the latest row per (layer,
    position) is the one later steps read); None when no trace holds routing."""
    if not any(t.has_routing for t in traces):
        return None
    return [t.routing(request_id) for t in traces]


def position_routing(rows: list[dict], request_id: str, position: int) -> PositionRouting:
    layers: dict[int, list] = {}
    for s, r in enumerate(rows):
        for i in np.flatnonzero(r["position"] == position):
            side = RoutingSide(int(r["step"][i]), [int(e) for e in r["experts"][i]],
                               [float(x) for x in r["scores"][i]], int(r["runner_up"][i]),
                               float(r["runner_up_score"][i]), int(r["input_hash"][i]))
            layers.setdefault(int(r["layer"][i]), [None] * len(rows))[s] = side
    return PositionRouting(request_id, position, [LayerRoutingRow(l, layers[l]) for l in sorted(layers)])
