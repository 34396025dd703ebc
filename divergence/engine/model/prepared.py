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
    """Everything the forward of `plan` needs, under attention `kernel` (PER_SEQ | BATCHED | PADDED).

    One builder for every kind of step, so a decode step and any other get their fields
    alike by construction: the rows from Python ints (a one-row slice, every decode step's,
    costs a few list appends; numpy per slice cost several times more), the batched call's
    mask, query and output rows with numpy over the batch, and only where it needs them."""
    bs = blocks.block_size
    sl = plan.slices
    # `padded` lays the rows out as BatchGenerator's [B, n] batch does: every slice padded
    # to the longest with token 0, so the linear ops see its row count and row positions
    # (OpenBLAS's fp32 bits depend on both); pad rows write their K/V to the spare block
    pad_to = max(s.count for s in sl) if kernel == PADDED and sl else 0
    padded_rows = pad_to > 0 and any(s.count != pad_to for s in sl)
    spare = blocks.num_blocks * bs
    toks, pos, slots, logit, real, tables, kv_lens, joins = [], [], [], [], [], [], [], []
    row = 0
    for si, s in enumerate(sl):
        assert s.row_offset == row, f"slice {s.request_id} starts at row {s.row_offset}, expected {row}"
        assert len(s.tokens) == s.count
        start, end = s.start, s.start + s.count
        t = blocks.tables[s.request_id][: -(-end // bs)]
        tables.append(t)
        kv_lens.append(end)
        joins.append(batchable(s))
        base = si * pad_to if padded_rows else row
        if s.count == 1:
            toks.append(s.tokens[0])
            pos.append(start)
            slots.append(t[start // bs] * bs + start % bs)
        else:
            toks.extend(s.tokens)
            pos.extend(range(start, end))
            slots.extend(t[p // bs] * bs + p % bs for p in range(start, end))
        if padded_rows:
            extra = pad_to - s.count
            real.extend(range(base, base + s.count))
            pos.extend(range(end, end + extra))
            slots.extend([spare] * extra)
            toks.extend([0] * extra)
        if s.logit_rows == (0,):
            logit.append(base)
        else:
            logit.extend(base + r for r in s.logit_rows)
        row += s.count
    T = len(sl) * pad_to if padded_rows else row
    identity_logits = logit == list(range(T))
    kv_lens = tuple(kv_lens)

    in_batch = [True] * len(sl) if kernel == PADDED else joins if kernel == BATCHED else [False] * len(sl)
    batch = [i for i, b in enumerate(in_batch) if b]
    groups = []
    if batch:
        left = kernel == PADDED and all(s.phase != PREFILL for s in sl) and len(set(kv_lens)) > 1
        groups.append(_batched(plan, batch, tables, bs, keep_mask=kernel == PADDED, pad_rows=padded_rows,
                               left_pad_slot=spare if left else None))
    order = None  # step rows in the order the groups produce them (None: in order)
    if len(batch) != len(sl):
        order = []
        for i in batch if not padded_rows else ():
            order.extend(range(sl[i].row_offset, sl[i].row_offset + sl[i].count))
        for i, s in enumerate(sl):
            if not in_batch[i]:
                t = tables[i]
                groups.append(SeqAttention(s.row_offset, s.count, kv_lens[i], mx.array(t, dtype=mx.int32),
                                           t[0] * bs if _consecutive(t) else None, t))
                order.extend(range(s.row_offset, s.row_offset + s.count))
    perm = None
    if order is not None and order != list(range(T)):
        perm = mx.array(np.argsort(np.asarray(order, dtype=np.int32)).astype(np.int32))
    return PreparedStep(
        plan=plan, rows=T, tokens=mx.array(toks, dtype=mx.int32), positions=mx.array(pos, dtype=mx.int32),
        write_slots=mx.array(slots, dtype=mx.int32), write_start=slots[0] if _consecutive(slots) else None,
        logit_index=None if identity_logits else mx.array(logit, dtype=mx.int32), logit_rows=len(logit),
        groups=groups, out_perm=perm, kernel=(PADDED if kernel == PADDED else BATCHED) if batch else PER_SEQ,
        kv_lens=kv_lens, real_rows=mx.array(real, dtype=mx.int32) if padded_rows else None,
        attended_rows=T, batch=len(batch),
        decode_queries=max((s.count for s, j in zip(sl, joins) if j), default=0),
        logit_host=None if identity_logits else tuple(logit),
    )


def _consecutive(ids: Sequence[int]) -> bool:
    """Each id one more than the one before (a block table read as one slice of the pool, or
    write slots as one slice update)."""
    return all(b - a == 1 for a, b in zip(ids, ids[1:]))


def _batched(plan: StepPlan, idx: list[int], tables: list[list[int]], bs: int, *,
             keep_mask: bool = False, pad_rows: bool = False, left_pad_slot: int | None = None) -> BatchedAttention:
    """The batched call of slices `idx`. pad_rows: the step's rows are already [B, Q] (slice b
    at rows b * Q ...): every row, pad rows included, is its own query and comes out in place.
    Plain ints where they do (a decode step's call, every step, builds no numpy array but
    its mask where lengths differ); the mask, query and output rows vectorized over B."""
    sl = [plan.slices[i] for i in idx]
    B = len(sl)
    counts, starts, offsets = [s.count for s in sl], [s.start for s in sl], [s.row_offset for s in sl]
    ends = [a + n for a, n in zip(starts, counts)]
    Q, L = max(counts), max(ends)
    nb = -(-L // bs) if keep_mask else batched_blocks(L, bs)  # (`padded`: BatchGenerator's calls, as they are)
    tab = [t + [t[0]] * (nb - len(t)) for t in (tables[i] for i in idx)]  # pad: any valid block, masked out
    row0 = 0 if pad_rows else offsets[0]
    contiguous = Q == 1 and (pad_rows or offsets == list(range(row0, row0 + B)))
    ragged = not pad_rows and min(counts) != Q
    # the mask masks nothing only where every slice is one row at the longest length
    masked = keep_mask or Q != 1 or min(ends) != L
    mask = left = q_index = out_rows = None
    if masked or not contiguous:  # each query row's place in its slice (padded ones repeat the last real one)
        n = np.asarray(counts)[:, None]
        q = np.broadcast_to(np.arange(Q), (B, Q)) if pad_rows else np.minimum(np.arange(Q)[None, :], n - 1)
    if masked:
        keys = np.arange(L)[None, None, :]
        seen = (np.asarray(starts)[:, None] + q)[:, :, None]  # query row q sits at start + q, sees up to it
        if left_pad_slot is None:
            mask = keys <= seen
        else:  # left-padded: the sequence's position p sits at key p + pad
            pad = (L - np.asarray(ends))[:, None, None]
            mask = (keys >= pad) & (keys - pad <= seen)
            left = np.full((B, L), left_pad_slot, dtype=np.int32)
            for b, (i, e) in enumerate(zip(idx, ends)):
                t = tables[i]
                left[b, L - e:] = [t[p // bs] * bs + p % bs for p in range(e)]
        mask = mask[:, None]
    if not contiguous:
        q_index = (np.arange(B * Q).reshape(B, Q) if pad_rows else np.asarray(offsets)[:, None] + q).reshape(-1)
    if ragged:
        out_rows = np.flatnonzero(np.arange(Q)[None, :] < np.asarray(counts)[:, None])  # b * Q + r, real rows
    return BatchedAttention(
        slices=tuple(idx), queries=Q, length=L, tables=mx.array(tab, dtype=mx.int32),
        mask=None if mask is None else mx.array(mask),
        q_index=None if q_index is None else mx.array(q_index.astype(np.int32)), row0=row0,
        out_index=None if out_rows is None else mx.array(out_rows.astype(np.int32)),
        left_slots=None if left is None else mx.array(left.reshape(-1)),
    )
