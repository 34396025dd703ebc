"""The decode fast path of prepare_step builds exactly what the general path builds."""
from __future__ import annotations

import dataclasses
import random

import mlx.core as mx
import numpy as np
import pytest

from divergence.core.events import DECODE, DRAFT, PREFILL, SeqSlice, StepPlan
from divergence.engine.sched.blocks import BlockManager
from divergence.engine.model.prepared import (
    BatchedAttention, PreparedStep, _prepare_decode, _prepare_general, prepare_step,
)


def _same(a, b, where: str) -> None:
    if isinstance(a, mx.array) or isinstance(b, mx.array):
        assert isinstance(a, mx.array) and isinstance(b, mx.array), where
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        assert np.array_equal(np.array(a), np.array(b)), where
    elif dataclasses.is_dataclass(a) and not isinstance(a, type):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            _same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def _decode_plan(rng: random.Random, blocks: BlockManager, n: int, *, equal: bool, phase: str) -> StepPlan:
    slices = []
    length = rng.randrange(1, 40)
    for i in range(n):
        rid = f"r{i}"
        start = length if equal else rng.randrange(0, 40)
        blocks.allocate(rid, start + 1)
        slices.append(SeqSlice(rid, phase, start, 1, i, (rng.randrange(100),),
                               (0,) if rng.random() < 0.9 or phase == DECODE else ()))
    return StepPlan(3, "target", tuple(slices))


@pytest.mark.parametrize("kernel", ["batched", "per-seq"])
@pytest.mark.parametrize("equal", [True, False])
@pytest.mark.parametrize("phase", [DECODE, DRAFT])
def test_decode_fast_path_matches_the_general_path(kernel, equal, phase):
    rng = random.Random(hash((kernel, equal, phase)) & 0xFFFF)
    for trial in range(12):
        blocks = BlockManager(400, 4)
        # interleaved allocation: some tables consecutive, some not
        for j in range(rng.randrange(3)):
            blocks.allocate(f"x{j}", rng.randrange(1, 9))
        plan = _decode_plan(rng, blocks, rng.randrange(1, 9), equal=equal, phase=phase)
        fast, general = _prepare_decode(plan, blocks, kernel), _prepare_general(plan, blocks, kernel)
        _same(fast, general, f"trial {trial}")
        assert isinstance(prepare_step(plan, blocks, kernel), PreparedStep)


def test_prefill_and_padded_steps_take_the_general_path(monkeypatch):
    blocks = BlockManager(16, 4)
    blocks.allocate("a", 5)
    decode = StepPlan(0, "target", (SeqSlice("a", DECODE, 4, 1, 0, (7,), (0,)),))
    prefill = StepPlan(0, "target", (SeqSlice("a", PREFILL, 0, 5, 0, (1, 2, 3, 4, 5), (4,)),))
    called = []
    import divergence.engine.model.prepared as P

    monkeypatch.setattr(P, "_prepare_decode", lambda *a: called.append(a) or _prepare_general(*a))
    P.prepare_step(prefill, blocks, "batched")
    P.prepare_step(decode, blocks, "padded")
    assert not called
    P.prepare_step(decode, blocks, "batched")
    assert len(called) == 1
    g = _prepare_decode(decode, blocks, "batched").groups[0]
    assert isinstance(g, BatchedAttention) and g.mask is None
