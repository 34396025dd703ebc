"""A step prepared once on the host: every index array the forward consumes.

The row layout of a step is decided here and nowhere else: slices sit one after the
other in plan order (slice i's rows start where slice i-1's end; the plan's
`row_offset`s must say so), every row's RoPE position is its sequence position, its
K/V go to the slot its block table gives, and attention reads each slice's first
`start + count` positions. The forward then runs the same ~20 MLX ops per layer
whatever the number of sequences: one RoPE call per q/k with per-row offsets, one
scatter per pool for every slice's K/V, and one SDPA call per attention group.

Attention groups: under the `batched` kernel every decode / verify / draft slice of
up to BATCH_MAX_QUERY rows goes into one masked SDPA call over block-gathered K/V,
right-padded to the longest; prefill slices (and everything under `per-seq`) get
one SDPA call each, exactly as a single-sequence engine (mlx-lm's generate_step)
makes it. Under `padded` every slice, prefill included, joins one call that always
carries its mask: mlx-lm BatchGenerator's calls, which a replay of its traces makes.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import numpy as np

from ...core.events import PREFILL, StepPlan
from ...core.names import BATCHED, PADDED, PER_SEQ
from ..kernels.read_rows import batched_blocks
from ..sched.blocks import BlockManager

BATCH_MAX_QUERY = 16  # longest non-prefill slice that joins the batched call (a verify is spec_k + 1)


def batchable(s) -> bool:
    """Does this slice join the step's batched attention call?"""
    return s.phase != PREFILL and s.count <= BATCH_MAX_QUERY


def batchable_count(plan: StepPlan) -> int:
    return sum(1 for s in plan.slices if batchable(s))


@dataclass
class SeqAttention:
    """One slice, its own SDPA call: rows [row, row + count) of the step."""

    batched: ClassVar[bool] = False  # (the kernels tell the two kinds of group apart by this)

    row: int
    count: int
    length: int  # KV positions read: start + count
    table: mx.array  # [ceil(length / block_size)] block ids
    first_slot: int | None = None  # the blocks are consecutive in the pool from this slot: read a slice, no gather
    host_table: Sequence[int] = ()  # `table`'s ids on the host (a list or numpy array)
    _padded: tuple = (0, None)  # (blocks, [1, blocks] table): made once per step, read by every layer

    def padded_table(self, blocks: int) -> mx.array:
        """[1, blocks] block ids: `table` extended with its last id (blocks past `length`
        are read into a buffer and never used), for a read into a buffer of that size."""
        if self._padded[0] != blocks:
            t = [int(b) for b in self.host_table[:blocks]]
            t += [t[-1]] * (blocks - len(t))
            self._padded = (blocks, mx.array([t], dtype=mx.int32))
        return self._padded[1]


@dataclass
class BatchedAttention:
    """Several slices in one SDPA call: [B, heads, Q, head_dim] queries, K/V [B, kv, L, hd]."""

    batched: ClassVar[bool] = True

    slices: tuple[int, ...]  # plan slice indices, in plan order
    queries: int  # Q: rows per slice, padded to the longest
    length: int  # L: the longest KV length
    tables: mx.array  # [B, nb] block ids (short rows padded with a valid block)
    # bool [B, 1, Q, L]: causal within each slice, nothing past its length. None when it
    # masks nothing (one query row each, every KV length equal: how batches of equal
    # prompts decode), except under `padded` (BatchGenerator passes its mask even then):
    # on MLX CUDA only an unmasked decode SDPA gets the fused vector kernel.
    mask: mx.array | None
    q_index: mx.array | None  # [B * Q] step rows to gather; None when the rows are [row0, row0 + B) (Q = 1)
    row0: int
    out_index: mx.array | None  # [rows] real rows of the [B * Q] output; None when no slice is padded
    # `padded` decode steps: K/V read position by position and left-padded ([B * L] pool slots,
    # pads from the spare block), as BatchGenerator's cache holds them after its prefill;
    # None: read by block (`tables`), right-padded
    left_slots: mx.array | None = None

    @property
    def layout(self) -> str:
        """How the call lays its sequences out (native_classes.LAYOUTS): "equal" (unmasked),
        "left" (left-padded) or "right" (right-padded)."""
        return "equal" if self.mask is None else "left" if self.left_slots is not None else "right"


@dataclass
class PreparedStep:
    plan: StepPlan
    rows: int  # T
    tokens: mx.array  # int32 [T]
    positions: mx.array  # int32 [T]: RoPE offset of each row
    write_slots: mx.array  # int32 [T]: pool slot each row's K/V go to
    write_start: int | None  # the slots are one consecutive run from here: a slice update, no scatter
    logit_index: mx.array | None  # int32 [R] rows whose logits are needed; None = all rows, in order
    logit_rows: int  # R
    groups: list  # SeqAttention | BatchedAttention, in execution order
    out_perm: mx.array | None  # attention rows in group order -> step order; None = already in order
    kernel: str  # PER_SEQ | BATCHED | PADDED: the step's attention kernel
    kv_lens: tuple[int, ...]  # per slice, in plan order
    attended_rows: int  # query rows across all groups (= T)
    batch: int  # slices in the batched call (0 under per-seq)
    decode_queries: int  # rows of the longest decode / verify slice (0: prefill only)
    # the plan's rows (slice order) within the step's T rows when `padded` padded them; None:
    # the rows are the plan's
    real_rows: mx.array | None = None
    logit_host: tuple[int, ...] | None = None  # logit_index on the host (None with it)

    @property
    def slice_lengths(self) -> list[int]:
        return [s.start + s.count for s in self.plan.slices]


def prepare_step(plan: StepPlan, blocks: BlockManager, kernel: str) -> PreparedStep:
    """Everything the forward of `plan` needs, under attention `kernel` (PER_SEQ | BATCHED | PADDED)."""
    if kernel != PADDED and plan.slices and all(s.count == 1 and s.phase != PREFILL for s in plan.slices):
        return _prepare_decode(plan, blocks, kernel)
    return _prepare_general(plan, blocks, kernel)


def _prepare_decode(plan: StepPlan, blocks: BlockManager, kernel: str) -> PreparedStep:
    """A step of one-row decode / draft slices (every decode step of a run): the same
    PreparedStep as _prepare_general, from Python ints instead of per-slice numpy arrays
    (several times cheaper, every decode step; tests/engine/test_prepared.py compares the two)."""
    bs = blocks.block_size
    sl = plan.slices
    B = len(sl)
    tabs, starts, slots, logit = [], [], [], []
    for i, s in enumerate(sl):
        assert s.row_offset == i, f"slice {s.request_id} starts at row {s.row_offset}, expected {i}"
        t = blocks.tables[s.request_id]
        p = s.start
        tabs.append(t[: p // bs + 1])
        starts.append(p)
        slots.append(t[p // bs] * bs + p % bs)
        logit.extend(i + r for r in s.logit_rows)
    kv_lens = tuple(p + 1 for p in starts)
    if kernel == BATCHED:
        L = max(kv_lens)
        nb = batched_blocks(L, bs)
        tab = mx.array([t + [t[0]] * (nb - len(t)) for t in tabs], dtype=mx.int32)
        mask = None
        if min(kv_lens) != L:  # each row sees its own positions only
            mask = mx.array((np.arange(L)[None, :] < np.asarray(kv_lens)[:, None])[:, None, None, :])
        groups = [BatchedAttention(tuple(range(B)), 1, L, tab, mask, None, 0, None)]
    else:
        groups = []
        for i, t in enumerate(tabs):
            consecutive = all(b - a == 1 for a, b in zip(t, t[1:]))
            groups.append(SeqAttention(i, 1, kv_lens[i], mx.array(t, dtype=mx.int32),
                                       t[0] * bs if consecutive else None, t))
    run = all(b - a == 1 for a, b in zip(slots, slots[1:]))
    identity_logits = logit == list(range(B))
    return PreparedStep(
        plan=plan, rows=B, tokens=mx.array([s.tokens[0] for s in sl], dtype=mx.int32),
        positions=mx.array(starts, dtype=mx.int32), write_slots=mx.array(slots, dtype=mx.int32),
        write_start=slots[0] if run else None,
        logit_index=None if identity_logits else mx.array(logit, dtype=mx.int32), logit_rows=len(logit),
        groups=groups, out_perm=None, kernel=BATCHED if kernel == BATCHED else PER_SEQ, kv_lens=kv_lens,
        attended_rows=B, batch=B if kernel == BATCHED else 0, decode_queries=1,
        logit_host=None if identity_logits else tuple(logit),
    )


def _prepare_general(plan: StepPlan, blocks: BlockManager, kernel: str) -> PreparedStep:
    bs = blocks.block_size
    toks, pos, slots, logit, real = [], [], [], [], []
    row = 0
    tables = []
    # `padded` lays the rows out as BatchGenerator's [B, n] batch does: every slice padded
    # to the longest with token 0, so the linear ops see its row count and row positions
    # (OpenBLAS's fp32 bits depend on both); pad rows write their K/V to the spare block
    pad_to = max(s.count for s in plan.slices) if kernel == PADDED and plan.slices else 0
    padded_rows = pad_to > 0 and any(s.count != pad_to for s in plan.slices)
    for si, s in enumerate(plan.slices):
        assert s.row_offset == row, f"slice {s.request_id} starts at row {s.row_offset}, expected {row}"
        assert len(s.tokens) == s.count
        end = s.start + s.count
        table = np.asarray(blocks.tables[s.request_id][: -(-end // bs)], dtype=np.int32)
        tables.append(table)
        p = np.arange(s.start, end, dtype=np.int32)
        base = si * pad_to if padded_rows else row
        slot = table[p // bs] * bs + p % bs
        tok = np.asarray(s.tokens, dtype=np.int32)
        if padded_rows:
            extra = pad_to - s.count
            real.extend(range(base, base + s.count))
            p = np.arange(s.start, s.start + pad_to, dtype=np.int32)
            slot = np.concatenate([slot, np.full(extra, blocks.num_blocks * bs, slot.dtype)])
            tok = np.concatenate([tok, np.zeros(extra, np.int32)])
        pos.append(p)
        slots.append(slot)
        toks.append(tok)
        logit.extend(base + r for r in s.logit_rows)
        row += s.count
    T = len(plan.slices) * pad_to if padded_rows else row
    cat = (lambda xs: np.concatenate(xs)) if len(plan.slices) != 1 else (lambda xs: xs[0])
    logit_np = np.asarray(logit, dtype=np.int32)
    identity_logits = len(logit_np) == T and np.array_equal(logit_np, np.arange(T))
    kv_lens = tuple(s.start + s.count for s in plan.slices)

    groups, order = [], []  # order: step rows in the order the groups produce them
    if kernel == PADDED:
        batch = list(range(len(plan.slices)))
    else:
        batch = [i for i, s in enumerate(plan.slices) if batchable(s)] if kernel == BATCHED else []
    if batch:
        left = kernel == PADDED and all(s.phase != PREFILL for s in plan.slices) and len(set(kv_lens)) > 1
        groups.append(_batched(plan, batch, tables, bs, keep_mask=kernel == PADDED, pad_rows=padded_rows,
                               left_pad_slot=blocks.num_blocks * bs if left else None))
        if padded_rows:
            order.extend(range(T))
        for i in batch if not padded_rows else ():
            s = plan.slices[i]
            order.extend(range(s.row_offset, s.row_offset + s.count))
    in_batch = set(batch)
    for i, s in enumerate(plan.slices):
        if i not in in_batch:
            t = tables[i]
            consecutive = len(t) == 1 or bool(np.all(np.diff(t) == 1))
            groups.append(SeqAttention(s.row_offset, s.count, kv_lens[i], mx.array(t),
                                       int(t[0]) * bs if consecutive else None, t))
            order.extend(range(s.row_offset, s.row_offset + s.count))
    slots_np = cat(slots).astype(np.int32)
    run = T == 1 or bool(np.all(np.diff(slots_np) == 1))
    perm = None
    if order != list(range(T)):
        perm = mx.array(np.argsort(np.asarray(order, dtype=np.int32)).astype(np.int32))
    return PreparedStep(
        plan=plan, rows=T, tokens=mx.array(cat(toks)), positions=mx.array(cat(pos)),
        write_slots=mx.array(slots_np), write_start=int(slots_np[0]) if run else None,
        logit_index=None if identity_logits else mx.array(logit_np), logit_rows=len(logit_np),
        groups=groups, out_perm=perm, kernel=(PADDED if kernel == PADDED else BATCHED) if batch else PER_SEQ,
        kv_lens=kv_lens, real_rows=mx.array(np.asarray(real, dtype=np.int32)) if padded_rows else None,
        attended_rows=T, batch=len(batch),
        decode_queries=max((s.count for s in plan.slices if batchable(s)), default=0),
        logit_host=None if identity_logits else tuple(int(i) for i in logit),
    )


def _batched(plan: StepPlan, idx: list[int], tables: list[np.ndarray], bs: int, *,
             keep_mask: bool = False, pad_rows: bool = False, left_pad_slot: int | None = None) -> BatchedAttention:
    """pad_rows: the step's rows are already [B, Q] (slice b at rows b * Q ...): every row,
    pad rows included, is its own query and comes out in place."""
    sl = [plan.slices[i] for i in idx]
    B = len(sl)
    Q = max(s.count for s in sl)
    L = max(s.start + s.count for s in sl)
    nb = -(-L // bs) if keep_mask else batched_blocks(L, bs)  # (`padded`: BatchGenerator's calls, as they are)
    tab = np.empty((B, nb), dtype=np.int32)
    mask = np.zeros((B, 1, Q, L), dtype=bool)
    q_index = np.empty((B, Q), dtype=np.int32)
    keys = np.arange(L)
    left = np.empty((B, L), dtype=np.int32) if left_pad_slot is not None else None
    out_rows = []
    for b, (i, s) in enumerate(zip(idx, sl)):
        t = tables[i]
        tab[b, : len(t)] = t
        tab[b, len(t):] = t[0]  # any valid block: masked out
        if pad_rows:
            q = np.arange(Q)
            q_index[b] = b * Q + q
        else:
            q = np.minimum(np.arange(Q), s.count - 1)  # padded query rows repeat the last real one
            q_index[b] = s.row_offset + q
        # query row q sits at position start + q and sees every position up to it
        if left_pad_slot is None:
            mask[b, 0] = keys[None, :] <= (s.start + q)[:, None]
        else:  # left-padded: the sequence's position p sits at key p + pad
            pad = L - (s.start + s.count)
            mask[b, 0] = (keys[None, :] >= pad) & (keys[None, :] - pad <= (s.start + q)[:, None])
            p = np.arange(s.start + s.count)
            left[b, :pad] = left_pad_slot
            left[b, pad:] = t[p // bs] * bs + p % bs
        out_rows.extend(b * Q + r for r in range(Q if pad_rows else s.count))
    rows = list(range(B * Q)) if pad_rows else [r for s in sl for r in range(s.row_offset, s.row_offset + s.count)]
    contiguous = Q == 1 and rows == list(range(rows[0], rows[0] + B))
    ragged = len(out_rows) != B * Q
    return BatchedAttention(
        slices=tuple(idx), queries=Q, length=L, tables=mx.array(tab),
        mask=None if mask.all() and not keep_mask else mx.array(mask),
        q_index=None if contiguous else mx.array(q_index.reshape(-1)), row0=rows[0],
        out_index=mx.array(np.asarray(out_rows, dtype=np.int32)) if ragged else None,
        left_slots=None if left is None else mx.array(left.reshape(-1)),
    )
