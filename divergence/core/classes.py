"""A probe's result: which row counts (or batch sizes, or message sizes) of one op
compute the same bits. Shared by the linear-op and attention probe map
(workloads/probe.py), the engine's native classes and the all-reduce probe."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class OpProbe:
    op: str  # e.g. "q_proj" (all layers share a shape) or "sdpa"
    shape: str  # "NxK" for linear ops
    dtype: str
    rows: list[int]
    classes: list[int]  # class per row count; class 0 = same bits as M=1
    layers: list[int] = field(default_factory=list)
    unit: str = "rows"  # what `rows` counts: rows of one call, or sequences of one attention call ("batch")
    base: str = "M=1"  # what class 0 means

    def describe(self) -> str:
        """Runs of row counts that compute every probe row as one-row calls do (= M=1) or
        not; calls of other row counts often each place rows their own way (distinct
        classes), so those are counted rather than listed."""
        if len(set(self.classes)) == 1 and self.classes[0] == 0:
            return f"{self.unit} {self.rows[0]}..{self.rows[-1]} one class (batch-invariant)"
        runs: list[list] = []
        for m, c in zip(self.rows, self.classes):
            same = c == 0
            if runs and runs[-1][2] == same:
                runs[-1][1] = m
                runs[-1][3].add(c)
            else:
                runs.append([m, m, same, {c}])
        parts = []
        for a, b, same, cls in runs:
            rng = f"{a}" if a == b else f"{a}..{b}"
            if same:
                parts.append(f"{rng} = {self.base}")
            elif len(cls) == 1:
                parts.append(f"{rng} class {next(iter(cls))}")
            else:
                parts.append(f"{rng} differ ({len(cls)} classes)")
        return f"{self.unit} " + ", ".join(parts)

    def to_json(self) -> dict:
        return {"op": self.op, "shape": self.shape, "dtype": self.dtype, "rows": self.rows, "unit": self.unit,
                "classes": self.classes, "layers": self.layers, "summary": self.describe()}


def classify(outputs: list) -> list[int]:
    """outputs[i]: the probe rows' bits (an array) or their signature (an int) at the i-th
    row count, the first being the base (M=1). Class 0 = equal to the base, then 1, 2, ...
    in order of appearance."""
    ids: dict = {}
    classes = []
    for o in outputs:
        key = o if isinstance(o, int) else np.ascontiguousarray(o).tobytes()
        if key not in ids:
            ids[key] = len(ids)
        classes.append(ids[key])
    return classes
