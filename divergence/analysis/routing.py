"""Routing flips: where a mixture-of-experts router sent a token to other experts.

A flip is the earliest (position, layer) on the path to a divergence (positions
the divergent step read, routed by the steps whose rows were live there) where
the two traces' chosen expert sets differ. Each routing record carries the hash
of the router's exact input row, so the flip explains itself: equal inputs mean
the router's own kernel in that step put the near-tied experts the other way;
different inputs mean the flip is a consequence of an earlier difference
(contaminated input: the root cause lies before it).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.labels import kernel_label
from ..core.names import GATE

CONTAMINATED_INPUT = "contaminated_input"
GATE_KERNEL = "gate_kernel"


@dataclass
class RoutingFlip:
    layer: int
    position: int
    step_a: int
    step_b: int
    experts_a: list[int]  # chosen experts, sorted
    experts_b: list[int]
    scores_a: dict[int, float]  # expert -> gate value in A (chosen + runner-up)
    scores_b: dict[int, float]
    cause: str  # CONTAMINATED_INPUT | GATE_KERNEL
    gate_a: str = "?"  # the router's kernel label in that step
    gate_b: str = "?"
    rows_a: int = 0  # rows the router saw in that step
    rows_b: int = 0

    @property
    def dropped(self) -> list[int]:
        """Chosen in A, not in B."""
        return sorted(set(self.experts_a) - set(self.experts_b))

    @property
    def added(self) -> list[int]:
        return sorted(set(self.experts_b) - set(self.experts_a))

    def to_json(self) -> dict:
        return {"layer": self.layer, "position": self.position, "step_a": self.step_a, "step_b": self.step_b,
                "experts_a": self.experts_a, "experts_b": self.experts_b,
                "scores_a": {str(k): v for k, v in self.scores_a.items()},
                "scores_b": {str(k): v for k, v in self.scores_b.items()},
                "cause": self.cause, "gate_kernel_a": self.gate_a, "gate_kernel_b": self.gate_b,
                "gate_rows_a": self.rows_a, "gate_rows_b": self.rows_b}

    def lines(self, label_a: str = "A", label_b: str = "B") -> list[str]:
        a = "{" + ", ".join(map(str, self.experts_a)) + "}"
        b = "{" + ", ".join(map(str, self.experts_b)) + "}"
        head = (f"    routing flip: layer {self.layer}, position {self.position}: experts {a} in {label_a}, "
                f"{b} in {label_b} (gate scores {self._scores(self.scores_a)} in {label_a}; "
                f"{self._scores(self.scores_b)} in {label_b})")
        if self.cause == GATE_KERNEL:
            why = (f"      from the gate's own kernel in that step: the router's input was bitwise equal; gate "
                   f"{self.gate_a} ({self.rows_a} rows) in {label_a} step {self.step_a}, {self.gate_b} "
                   f"({self.rows_b} rows) in {label_b} step {self.step_b}")
        else:
            why = (f"      from contaminated input: the router's input row already differed (an earlier op or "
                   f"step), {label_a} step {self.step_a}, {label_b} step {self.step_b}")
        return [head, why]

    def _scores(self, scores: dict[int, float]) -> str:
        """'7: 0.21034, 5: 0.21031' for the experts that swapped (more digits where 5 hide the gap)."""
        pair = self.dropped + self.added
        vals = [scores.get(e) for e in pair]
        known = [v for v in vals if v is not None]
        fmt = "{:.5f}"
        if len(set(known)) > len({fmt.format(v) for v in known}):
            fmt = "{:.9g}"
        text = ", ".join(f"{e}: " + (fmt.format(v) if v is not None else "?") for e, v in zip(pair, vals))
        return text + (" (exact tie)" if len(known) > 1 and len(set(known)) == 1 else "")


def find_routing_flip(a, b, request_id: str, *, position: int, step_a: int, step_b: int) -> RoutingFlip | None:
    """The earliest routing flip among the rows at positions < `position` live when the
    divergent steps (step_a in A, step_b in B) ran; None when the routing agrees."""
    if not (a.has_routing and b.has_routing):
        return None
    ra = a.routing(request_id, at_step=step_a)
    rb = b.routing(request_id, at_step=step_b)
    sel_a, sel_b = np.flatnonzero(ra["position"] < position), np.flatnonzero(rb["position"] < position)
    common, ja, jb = np.intersect1d(_keys(ra)[sel_a], _keys(rb)[sel_b], assume_unique=True, return_indices=True)
    if not common.size:
        return None
    ia, ib = sel_a[ja], sel_b[jb]
    ea = np.sort(ra["experts"][ia], axis=1)
    eb = np.sort(rb["experts"][ib], axis=1)
    differ = np.flatnonzero((ea != eb).any(axis=1))
    if not differ.size:
        return None
    j = int(differ[0])  # keys sort by (position, layer): the earliest
    i, k = int(ia[j]), int(ib[j])
    layer, pos = int(ra["layer"][i]), int(ra["position"][i])
    sa, sb = int(ra["step"][i]), int(rb["step"][k])
    same_input = ra["input_hash"][i] == rb["input_hash"][k]
    flip = RoutingFlip(layer, pos, sa, sb, ea[j].tolist(), eb[j].tolist(), _scores(ra, i), _scores(rb, k),
                       GATE_KERNEL if same_input else CONTAMINATED_INPUT)
    flip.gate_a, flip.rows_a = _gate(a, sa, layer)
    flip.gate_b, flip.rows_b = _gate(b, sb, layer)
    return flip


def _keys(r: dict) -> np.ndarray:
    return r["position"].astype(np.int64) * 65536 + r["layer"]  # sorts by (position, layer)


def _scores(r: dict, i: int) -> dict[int, float]:
    out = {int(e): float(s) for e, s in zip(r["experts"][i], r["scores"][i])}
    if int(r["runner_up"][i]) >= 0:
        out[int(r["runner_up"][i])] = float(r["runner_up_score"][i])
    return out


def _gate(trace, step: int, layer: int) -> tuple[str, int]:
    ks = trace.kernels(step=step)
    sel = np.flatnonzero((ks["op"] == GATE) & (ks["layer"] == layer))
    if not sel.size:
        return "?", 0
    i = int(sel[0])
    return kernel_label(str(ks["kernel"][i]), int(ks["splits"][i])), int(ks["rows"][i])
