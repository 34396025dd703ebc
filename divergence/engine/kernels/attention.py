"""The attention kernels: SDPA over the paged cache, per sequence or batched.

`per-seq`: each slice its own `scaled_dot_product_attention` over exactly its own
K/V (no mask for one query row, "causal" for several), the call mlx-lm's
generate_step makes. `batched`: the step's decode / verify slices in one call over
K/V gathered block by block and right-padded to the longest, with a boolean mask
(causal inside a slice, nothing past its length), the call a batched engine makes;
no mask where it would mask nothing (equal lengths, one row each). `padded`:
BatchGenerator's calls, every slice of the step in one masked call, decode K/V read
left-padded (prepared.py lays the rows out). On MLX's CPU backend the two agree bit for bit for one-row queries (fp32 and bf16)
and for verify rows in bf16; with OpenBLAS fp32 the padded reduction length changes
verify rows in the last bit. On MLX CUDA a masked SDPA takes another kernel than an
unmasked one: there they differ, as batched engines' outputs do.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from .read_rows import KV_STEP, batched_blocks

if TYPE_CHECKING:  # the step's layout and the cache are read, never built, here (model/ imports kernels/)
    from ..model.kv_cache import PagedKVCache
    from ..model.prepared import BatchedAttention, PreparedStep, SeqAttention

sdpa = mx.fast.scaled_dot_product_attention
MLXLM, STABLE = "mlx-lm", "stable"  # how a one-row call reads K/V on the GPU (see attend)


def mlxlm_reads(g: SeqAttention, layer: int, cache: PagedKVCache) -> tuple[mx.array, mx.array]:
    """One sequence's K and V [1, kv_heads, L, hd] for a one-row SDPA on the GPU, laid out
    as mlx-lm's KVCache hands them to SDPA: a view of a buffer grown KV_STEP positions at a
    time, so row-contiguous when L fills it and strided by the buffer's length otherwise.
    On MLX CUDA a one-row SDPA over 256 or more positions gives other numbers for other
    strides (docs/architecture.md), so the layout is part of mlx-lm's numbers
    there; under 256 every layout gives the same numbers, so the
    pool's own slice is read with no copy. The buffer is made by one block gather per
    pool (the table padded to the buffer's blocks; rows past L hold whatever those blocks
    hold and are never read): one kernel each for K and V, where copying the pool's slice
    into a padded buffer took two (a fill and a copy). The CPU's SDPA reads every layout
    alike, and multi-row (prefill, verify) queries on CUDA took no better to it: both
    read the pool as it is."""
    L = g.length
    if L < KV_STEP:
        return cache.gather(layer, g.table, L, first_slot=g.first_slot)
    rows = -(-L // KV_STEP) * KV_STEP
    if rows % cache.block_size == 0:
        return cache.gather_batch(layer, g.padded_table(rows // cache.block_size), L)
    k, v = cache.gather(layer, g.table, L, first_slot=g.first_slot)  # (a block size that does not divide 256)
    return _in_buffer(k, rows), _in_buffer(v, rows)


def stable_reads(g: SeqAttention, layer: int, cache: PagedKVCache) -> tuple[mx.array, mx.array]:
    """One sequence's K and V [1, kv_heads, L, hd] for a one-row SDPA on the GPU, read as the
    batched call reads them (its layout at B=1: batched_blocks), so that from 256 positions
    the call always runs the vector kernel. mlx-lm's layout (mlxlm_reads) takes cuDNN or the
    vector kernel as the allocator happens to size its buffer, so the same sequence could
    get other bits run after run: what `batch-invariant` and `gemv` promise, one sequence's
    bits whatever the batch, holds only if they are the same bits every run. Under 256
    positions every layout gives the same numbers: the pool's own slice, as mlxlm_reads."""
    L = g.length
    if L < KV_STEP:
        return cache.gather(layer, g.table, L, first_slot=g.first_slot)
    return cache.gather_batch(layer, g.padded_table(batched_blocks(L, cache.block_size)), L)


def _in_buffer(x: mx.array, rows: int) -> mx.array:
    """x [1, kv_heads, L, hd] copied into a new [1, kv_heads, rows, hd] buffer, viewed as its
    first L rows. (When rows == L, `x * 1`: a new buffer of exactly x's bits, where
    mx.contiguous would hand back a one-KV-head pool slice as a view at an offset.)"""
    L = x.shape[2]
    return mx.pad(x, [(0, 0), (0, 0), (0, rows - L), (0, 0)])[:, :, :L] if rows > L else x * 1


def run_per_seq(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """One sequence: q [1, heads, n, hd] over its own k, v [1, kv_heads, L, hd]."""
    return sdpa(q, k, v, scale=scale, mask="causal" if q.shape[2] > 1 else None)


def run_batched(q: mx.array, k: mx.array, v: mx.array, mask: mx.array, scale: float) -> mx.array:
    """B sequences: q [B, heads, Q, hd] over padded k, v [B, kv_heads, L, hd], bool mask [B, 1, Q, L]
    (None: nothing to mask).
    (Looked up per call, like kernels.run_native: tests swap in other backends' behaviour.)"""
    return sdpa(q, k, v, scale=scale, mask=mask)


# The kernels as defined here, taken when this module loads: a stand-in swapped in for the
# module's names later (tests, another backend's behaviour) is not them, whenever the
# modules that ask (native_classes: what may be stored on disk) are first imported.
OWN_KERNELS = (run_per_seq, run_batched)


def attend(prep: PreparedStep, layer: int, q: mx.array, cache: PagedKVCache, scale: float,
           onerow: str = MLXLM) -> mx.array:
    """q: [T, heads, 1, head_dim] (after RoPE) -> [T, heads * head_dim] in step row order.
    onerow: how a one-row call reads K/V on the GPU: MLXLM (mlxlm_reads: generate_step's
    numbers) or STABLE (stable_reads: the same numbers every run)."""
    T, H, _, hd = q.shape
    outs = []
    for g in prep.groups:
        if not g.batched:
            outs.append(_one(g, layer, q, cache, scale, onerow))
        else:
            outs.append(_batched(g, layer, q, cache, scale))
    a = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
    return a if prep.out_perm is None else a[prep.out_perm]


def _one(g: SeqAttention, layer: int, q: mx.array, cache: PagedKVCache, scale: float, onerow: str) -> mx.array:
    _, H, _, hd = q.shape
    n = g.count
    if n == 1:
        qs = q[g.row : g.row + 1].reshape(1, H, 1, hd)
    else:
        qs = q[g.row : g.row + n].reshape(n, H, hd).transpose(1, 0, 2)[None]
    if n == 1 and mx.default_device() == mx.gpu:  # (one-row queries; see mlxlm_reads)
        k, v = (mlxlm_reads if onerow == MLXLM else stable_reads)(g, layer, cache)
    else:
        k, v = cache.gather(layer, g.table, g.length, first_slot=g.first_slot)
    o = run_per_seq(qs, k, v, scale)
    return o.reshape(1, H * hd) if n == 1 else o[0].transpose(1, 0, 2).reshape(n, H * hd)


def _batched(g: BatchedAttention, layer: int, q: mx.array, cache: PagedKVCache, scale: float) -> mx.array:
    _, H, _, hd = q.shape
    B, Q = g.tables.shape[0], g.queries
    if g.q_index is None:
        qs = q[g.row0 : g.row0 + B]  # [B, H, 1, hd]
    elif Q == 1:
        qs = q[g.q_index]
    else:
        qs = q[g.q_index].reshape(B, Q, H, hd).transpose(0, 2, 1, 3)
    if g.left_slots is not None:
        k, v = cache.gather_positions(layer, g.left_slots, B, g.length)
    else:
        k, v = cache.gather_batch(layer, g.tables, g.length)
    o = run_batched(qs, k, v, g.mask, scale)  # [B, H, Q, hd]
    o = o.reshape(B, H * hd) if Q == 1 else o.transpose(0, 2, 1, 3).reshape(B * Q, H * hd)
    return o if g.out_index is None else o[g.out_index]
