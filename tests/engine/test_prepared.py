"""prepare_step, one builder for every kind of step, against what a plan says, field by field.

Random plans (decode, draft, verify, prefill mixed with decode; block sizes 1, 4, 16;
tables interleaved so some are not consecutive) under every attention kernel. Each field
is checked against a plain reading of the plan: the rows' tokens, positions and write slots
(`padded`'s pad rows included), the logit rows, and for the attention groups every real
query row's keys (through the group's table, mask or left-padded slots) and where its output
lands (q_index, out_index, out_perm). tests/engine/test_attention.py runs the groups' SDPA
against a numpy reference.
"""
from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from divergence.core.events import DECODE, DRAFT, PREFILL, SeqSlice, StepPlan
from divergence.engine.model.prepared import BATCH_MAX_QUERY, BatchedAttention, SeqAttention, prepare_step
from divergence.engine.sched.blocks import BlockManager

KERNELS = ("batched", "per-seq", "padded")


def _plan(rng: random.Random, kind: str, bs: int) -> tuple[StepPlan, BlockManager]:
    blocks = BlockManager(2000, bs)
    slices, row = [], 0
    equal = kind == "decode" and rng.random() < 0.3  # a batch of equal lengths: an unmasked call
    length = rng.randrange(0, 60)
    for i in range(rng.randrange(1, 9)):
        for j in range(rng.randrange(2)):  # interleaved allocations: tables not always consecutive
            blocks.allocate(f"x{i}.{j}", rng.randrange(1, 3 * bs))
        if kind == "decode":
            phase, count = rng.choice([DECODE, DRAFT]), 1
        elif kind == "verify":
            phase, count = DECODE, rng.randrange(1, 6)
        else:
            phase = rng.choice([PREFILL, DECODE])
            count = rng.randrange(1, 40) if phase == PREFILL else rng.choice([1, rng.randrange(1, 20)])
        start = length if equal else rng.randrange(0, 60)
        blocks.allocate(f"r{i}", start + count)
        if count == 1:
            logit = (0,) if rng.random() < 0.9 else ()
        else:
            logit = tuple(sorted(rng.sample(range(count), rng.randrange(0, count + 1))))
        slices.append(SeqSlice(f"r{i}", phase, start, count, row, tuple(rng.randrange(500) for _ in range(count)),
                               logit))
        row += count
    return StepPlan(7, "target", tuple(slices)), blocks


def _slot(blocks: BlockManager, rid: str, p: int) -> int:
    t = blocks.tables[rid]
    return t[p // blocks.block_size] * blocks.block_size + p % blocks.block_size


def _host(a) -> list:
    return np.asarray(a).tolist()


def _check(plan: StepPlan, blocks: BlockManager, kernel: str) -> None:
    prep = prepare_step(plan, blocks, kernel)
    sl, bs = plan.slices, blocks.block_size
    spare = blocks.num_blocks * bs
    n = max(s.count for s in sl)
    padded_rows = kernel == "padded" and any(s.count != n for s in sl)
    width = n if padded_rows else None
    # -- rows: slice i at row_offset (padded: at i * n, its pad rows after it)
    base = [i * n if padded_rows else s.row_offset for i, s in enumerate(sl)]
    tokens, positions, slots, real = [], [], [], []
    for b, s in zip(base, sl):
        real += range(b, b + s.count)
        tokens += list(s.tokens)
        positions += range(s.start, s.start + s.count)
        slots += [_slot(blocks, s.request_id, p) for p in range(s.start, s.start + s.count)]
        if width:
            pad = width - s.count
            tokens += [0] * pad
            positions += range(s.start + s.count, s.start + width)
            slots += [spare] * pad
    T = len(tokens)
    assert prep.rows == prep.attended_rows == T
    assert (_host(prep.tokens), _host(prep.positions), _host(prep.write_slots)) == (tokens, positions, slots)
    assert prep.tokens.dtype == prep.positions.dtype == prep.write_slots.dtype == mx.int32
    run = all(b - a == 1 for a, b in zip(slots, slots[1:]))
    assert prep.write_start == (slots[0] if run else None)
    assert (prep.real_rows is None) == (not padded_rows)
    if padded_rows:
        assert _host(prep.real_rows) == real
    logit = [b + r for b, s in zip(base, sl) for r in s.logit_rows]
    assert prep.logit_rows == len(logit)
    if logit == list(range(T)):
        assert prep.logit_index is None and prep.logit_host is None
    else:
        assert _host(prep.logit_index) == logit and prep.logit_host == tuple(logit)
    assert prep.kv_lens == tuple(s.start + s.count for s in sl)
    joins = [s.phase != PREFILL and s.count <= BATCH_MAX_QUERY for s in sl]
    assert prep.decode_queries == max((s.count for s, j in zip(sl, joins) if j), default=0)
    batch = [i for i in range(len(sl)) if kernel == "padded" or (kernel == "batched" and joins[i])]
    assert prep.batch == len(batch)
    assert prep.kernel == (("padded" if kernel == "padded" else "batched") if batch else "per-seq")
    # -- attention: each real query row reads its own keys, and its output lands on its row
    produced = []  # step rows in the order the groups' outputs come
    for g in prep.groups:
        if isinstance(g, SeqAttention):
            i = next(i for i, s in enumerate(sl) if s.row_offset == g.row)
            s = sl[i]
            assert i not in batch and (g.count, g.length) == (s.count, s.start + s.count)
            want = blocks.tables[s.request_id][: -(-g.length // bs)]
            assert list(g.host_table) == want and _host(g.table) == want
            consecutive = all(b - a == 1 for a, b in zip(want, want[1:]))
            assert g.first_slot == (want[0] * bs if consecutive else None)
            produced += range(g.row, g.row + g.count)
            continue
        assert isinstance(g, BatchedAttention) and list(g.slices) == batch
        B, Q, L = len(batch), g.queries, g.length
        assert Q == max(sl[i].count for i in batch) and L == max(sl[i].start + sl[i].count for i in batch)
        tables = np.asarray(g.tables)
        mask = None if g.mask is None else np.asarray(g.mask)
        assert mask is None or mask.shape == (B, 1, Q, L)
        left = None if g.left_slots is None else np.asarray(g.left_slots).reshape(B, L)
        q_index = np.arange(g.row0, g.row0 + B * Q) if g.q_index is None else np.asarray(g.q_index)
        out = np.arange(B * Q) if g.out_index is None else np.asarray(g.out_index)
        rows_out = []
        for b, i in enumerate(batch):
            s = sl[i]
            queries = range(width or s.count)
            for r in queries:
                assert q_index[b * Q + r] == base[i] + r, (b, r)  # query row b*Q + r is step row base + r
                rows_out.append(b * Q + r)
                if r >= s.count:
                    continue  # a pad row's attention is never read
                p = s.start + r  # it sees positions 0..p, through its keys' slots
                if left is None:
                    seen = [k for k in range(L) if mask is None or mask[b, 0, r, k]]
                    assert seen == list(range(p + 1)), (b, r)
                    got = [tables[b, k // bs] * bs + k % bs for k in seen]
                else:
                    seen = [k for k in range(L) if mask[b, 0, r, k]]
                    got = [left[b, k] for k in seen]
                assert got == [_slot(blocks, s.request_id, k) for k in range(p + 1)], (b, r)
        assert out.tolist() == rows_out
        produced += [int(q_index[j]) for j in out]
    assert sorted(produced) == list(range(T))
    perm = None if prep.out_perm is None else _host(prep.out_perm)
    assert (produced if perm is None else [produced[j] for j in perm]) == list(range(T))


@pytest.mark.parametrize("kind", ["decode", "verify", "mixed"])
@pytest.mark.parametrize("bs", [1, 4, 16])
def test_prepared_steps_are_what_the_plan_says(kind, bs):
    rng = random.Random(f"{kind}{bs}")
    for _ in range(25):
        plan, blocks = _plan(rng, kind, bs)
        for kernel in KERNELS:
            _check(plan, blocks, kernel)


def test_a_decode_batch_of_equal_lengths_is_one_unmasked_call():
    blocks = BlockManager(64, 4)
    for i in range(3):
        blocks.allocate(f"r{i}", 10)
    plan = StepPlan(0, "target", tuple(SeqSlice(f"r{i}", DECODE, 9, 1, i, (7,), (0,)) for i in range(3)))
    g = prepare_step(plan, blocks, "batched").groups[0]
    assert isinstance(g, BatchedAttention) and g.mask is None and g.q_index is None and g.out_index is None
    assert prepare_step(plan, blocks, "padded").groups[0].mask is not None  # BatchGenerator passes its mask
    _check(plan, blocks, "batched")
