"""The kernels table's records of steps given as rows (StepKernels): a step whose rows equal
the step before's reuses that step's records; the records are what encoding every row afresh
makes, whatever the order of repeated and new steps, and across encodings."""
from __future__ import annotations

import numpy as np
import pytest

from divergence.core.events import StepKernels
from divergence.trace import schema as S
from divergence.trace.encode import Batch, Encoder


def _encoder() -> Encoder:
    dtypes = {name: S.record_dtype(t, {"top_k": 4}) for name, t in S.TABLES.items()}
    return Encoder(dtypes, {}, S.CODE_TABLES)


def _rows(m: int, layers: int = 3) -> list[tuple]:
    ops = ("q_proj", "k_proj", "o_proj")
    return [("target", layer, op, m, "native", m, 64, 32, 1, 7, -1, 0) for layer in range(layers) for op in ops]


def _attention_like(rows: list[tuple], kv: int) -> list[tuple]:
    """`rows` with every third one (a decode step's attention rows) carrying KV length `kv`."""
    return [r[:7] + (kv,) + r[8:11] + (kv,) if i % 3 == 2 else r for i, r in enumerate(rows)]


@pytest.mark.parametrize("pattern", ["aaaa", "abab", "aabba", "abbb", "a", "ab0a", "0aa0", "acde", "acca", "abcd",
                                     "ac0d", "cdcd"])
def test_repeated_steps_give_the_records_of_their_rows(pattern):
    """b: every row differs from a's (made anew); c, d, e: a third of a's rows differ (the
    others' records are reused, those rows made anew)."""
    a = _rows(8)
    shared = {"a": a, "b": _rows(3), "c": _attention_like(a, 40), "d": _attention_like(a, 41),
              "e": _attention_like(a, 42)}
    steps = []
    for i, c in enumerate(pattern * 2):
        rows = [] if c == "0" else list(shared[c]) if i % 2 else [tuple(r) for r in shared[c]]  # equal, or the same
        steps.append(StepKernels(10 + i, rows))
    enc = _encoder()
    got = []
    for part in (steps[: len(pattern)], steps[len(pattern):]):  # two encodings: the block carries over
        batch = Batch()
        for sk in part:
            batch.add("kernels", sk)
        got += enc.encode(batch).get("kernels", [])
    got = np.concatenate(got) if got else np.empty(0, enc.dtypes["kernels"])
    want = _encoder()._kernel_rows([sk for sk in steps if sk.rows])
    assert got.dtype == want.dtype and len(got) == len(want) == sum(len(sk.rows) for sk in steps)
    assert got.tobytes() == want.tobytes()
    assert list(got["step"]) == [sk.step for sk in steps for _ in sk.rows]
