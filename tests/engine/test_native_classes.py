"""The native-class probe: enough output values to see a kernel switch, at a bounded cost.

A wide op (a vocabulary head) gets fewer probe rows than a narrow one: its one-row
signature must not cost 32 full reads of the weights, and must still tell a GEMV from
a split-K GEMM.
"""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from divergence.engine.kernels import linear as kernels
from divergence.engine.kernels.native_classes import PROBE_ROWS, PROBE_VALUES, NativeClassProbe, probe_rows


def test_probe_rows_by_width():
    assert probe_rows(128) == probe_rows(8192) == PROBE_ROWS  # every hidden-size op: all rows
    assert probe_rows(151_936) == 2  # Qwen2.5's head: 2 rows, 303,872 values
    assert probe_rows(10**9) == 1
    for n in (100, 5000, 20_000, 151_936):
        assert probe_rows(n) * n >= min(PROBE_VALUES, PROBE_ROWS * n)


def _wide_op(n: int = 40_000, k: int = 256) -> kernels.LinearOp:
    lin = nn.Linear(k, n, bias=False)
    lin.weight = (mx.random.normal((n, k), key=mx.random.key(3)) * k ** -0.5).astype(mx.bfloat16)
    return kernels.LinearOp.from_module("lm_head", lin)


def test_wide_op_probe_is_cheap_and_still_sees_a_kernel_switch():
    op = _wide_op()
    calls: list[int] = []

    def gpu_like(x, o):  # one row at a time up to 4 rows, a split-K GEMM above
        calls.append(x.shape[0])
        m = x.shape[0]
        return kernels.run_gemv(x, o) if m <= 4 else kernels.run_gemm(x, o, kernels.gemm_splits(m, o.n, o.k))

    probe = NativeClassProbe(gpu_like)
    one = probe.signature(op, 1, mx.bfloat16)
    assert len(calls) == probe_rows(op.n) < PROBE_ROWS  # not 32 one-row calls
    calls.clear()
    cls = probe.classes(op, [1, 2, 4, 8, 64], mx.bfloat16)
    assert cls[:3] == [0, 0, 0] and 0 not in cls[3:]  # the GEMV rows are one class, the GEMM's not
    assert probe.signature(op, 1, mx.bfloat16) == one  # memoised, same rows whatever M
    rows = probe_rows(op.n)
    assert calls == [2] * -(-rows // 2) + [4] * -(-rows // 4) + [8, 64]  # no call beyond the probe rows
