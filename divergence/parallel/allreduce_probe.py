"""`probe --tp N`: does the all-reduce itself depend on the message size?

Run on every rank of the group (the CLI starts them). Each rank holds its own rows
(seeded by rank); for every row count M the ranks all-reduce M rows of the model's
hidden width, and the probe rows' bits are compared with the same rows all-reduced
one at a time (M = 1). With two ranks a + b = b + a, so nothing can depend on M; with
three or more a ring reduce-scatter splits the buffer into N segments by size, each
summed in a ring order that starts at another rank, so where a row's elements fall,
and with it the order of their sum, can change with the batch. Each M is also
compared with the sum in rank order (x0 + x1 + ... + x{N-1}).
"""
from __future__ import annotations

from ..engine.kernels import blas as _blas  # noqa: F401  (loads the optimized BLAS: must precede mlx)
import mlx.core as mx
import numpy as np

from ..engine.kernels.bits import raw_bits as _bits
from ..core.classes import OpProbe, classify

PROBE_ROWS = 32  # rows compared at each row count (as the linear-op probe)


def probe_allreduce(tp, width: int, dtype, rows: list[int]) -> dict:
    g = tp.group
    biggest = max(rows)
    x = mx.random.normal((max(biggest, PROBE_ROWS), width), key=mx.random.key(1000 + tp.rank)).astype(dtype)
    p = min(PROBE_ROWS, biggest)
    alone = mx.concatenate([mx.distributed.all_sum(x[i:i + 1], group=g) for i in range(p)], axis=0)
    mx.eval(alone)
    base = _bits(alone)
    outputs, rank_order = [base], []
    for m in rows:
        y = mx.distributed.all_sum(x[:m], group=g)
        parts = mx.distributed.all_gather(x[:m], group=g).reshape(tp.size, m, width)
        ref = parts[0]
        for r in range(1, tp.size):
            ref = ref + parts[r]
        mx.eval(y, ref)
        got = base.copy()
        k = min(m, p)
        got[:k] = _bits(y[:k])
        outputs.append(got)
        rank_order.append(bool(np.array_equal(_bits(y), _bits(ref))))
    classes = classify(outputs)[1:]
    name = str(dtype).replace("mlx.core.", "")
    op = OpProbe("all_reduce", f"{width}", name, list(rows), classes)
    return {**op.to_json(), "ranks": tp.size, "backend": tp.backend, "size_invariant": len(set(classes)) == 1,
            "equals_rank_order": rank_order}


def probe_tp(tp, width: int, dtypes, rows: list[int]) -> dict:
    from ..engine.kernels.environment import environment

    return {"tp": tp.describe(), "environment": environment(),
            "allreduce": [probe_allreduce(tp, width, d, rows) for d in dtypes]}
