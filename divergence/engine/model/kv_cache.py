"""Paged KV cache memory (which blocks belong to which request: sched/blocks.py).

`PagedKVCache` owns the memory: per layer one head-major pool of [kv_heads, num_blocks * block_size,
head_dim] that one scatter per step writes into (MLX donates the buffer: no
whole-cache copy) and reads gather from block by block.
"""
from __future__ import annotations

import mlx.core as mx

from ..kernels.kv_reads import KvReads


class PagedKVCache(KvReads):
    """K/V memory of one model: a pool per layer, stored head-major [1, kv_heads, slots,
    head_dim] (slot = block * block_size + offset), so a sequence's K/V are read whole
    blocks at a time and come out already in SDPA's [B, kv_heads, L, head_dim] layout
    (no gather position by position and no transpose). The leading 1 is SDPA's batch axis: a sequence whose
    blocks are consecutive is read as a slice of the pool, no op added (a 3-d pool took
    an expand_dims per read, two per layer of every B=1 step)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype):
        self.block_size = block_size
        # one spare block past the BlockManager's ids: where the pad rows of a `padded`
        # step (prepared.py) write their K/V; no sequence ever reads it
        num_blocks += 1
        self.num_blocks = num_blocks
        self.kv_heads, self.head_dim = kv_heads, head_dim
        shape = (1, kv_heads, num_blocks * block_size, head_dim)
        self.k = [mx.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.v = [mx.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        # batched block reads index the pool viewed as [kv_heads * blocks, block_size, head_dim]:
        # one index array (head * blocks + block), ~10% faster than indexing two axes
        self._head_ids = mx.arange(kv_heads, dtype=mx.int32)[:, None]  # [kv_heads, 1]
        self._head_base = (self._head_ids * num_blocks)[None]  # [1, kv_heads, 1]
        self._flat: tuple = (None, None)  # (tables, their flat index): made once per step, used by every layer
        self._heads: dict[int, tuple] = {}  # rows written -> ([kv_heads, rows] zeros, head index) of a scatter
        self._scatter: tuple = (None, None)  # (slots, their scatter index): made once per step
        mx.eval(self.k, self.v, self._head_ids, self._head_base)

    def write(self, layer: int, slots: mx.array, k: mx.array, v: mx.array, *, start: int | None = None) -> None:
        """k, v: [n, kv_heads, head_dim], or [n, kv_heads, 1, head_dim] (the forward's RoPE
        layout), for the n positions at `slots`: one scatter per pool, in place (MLX
        donates the buffer: no whole-cache copy). `start`: the slots are start, start + 1,
        ...: a slice update does it (cheaper than a scatter; from the RoPE layout one
        transpose gives the pool's [1, kv_heads, n, head_dim])."""
        if start is not None:
            n = k.shape[0]
            self.k[layer][:, :, start : start + n] = _as_pool_rows(k)
            self.v[layer][:, :, start : start + n] = _as_pool_rows(v)
            return
        index = self._write_index(slots)
        # [kv_heads, n, head_dim] rows to [kv_heads, n] indices: a scatter with no added op
        # (a [1, kv_heads, n] index would broadcast and squeeze the rows first)
        self.k[layer][index] = _as_head_rows(k)
        self.v[layer][index] = _as_head_rows(v)

    def _write_index(self, slots: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """[kv_heads, n] index arrays (batch 0, head, slot) of a scatter to `slots`, made once
        per step (every layer's write reuses them). `pool[:, :, slots] = x` would build them
        per call: an arange, casts and copies per scatter, ~200 small kernels a step on MLX
        CUDA for a 24-layer model (the same bits: a scatter only moves values)."""
        if self._scatter[0] is not slots:
            n = slots.shape[0]
            fixed = self._heads.get(n)
            if fixed is None:
                heads = mx.broadcast_to(self._head_ids, (self._head_ids.shape[0], n)) + 0
                fixed = self._heads[n] = (mx.zeros_like(heads), heads)
            zero, heads = fixed
            self._scatter = (slots, (zero, heads, slots[None, :] + zero))
        return self._scatter[1]

    def read(self, layer: int, slots: mx.array) -> tuple[mx.array, mx.array]:
        """[n, kv_heads, head_dim] at `slots` (position by position; tests and tools)."""
        return self.k[layer][0][:, slots].swapaxes(0, 1), self.v[layer][0][:, slots].swapaxes(0, 1)

    def _pools(self, layer: int) -> tuple[mx.array, mx.array]:
        return self.k[layer], self.v[layer]

    def arrays(self) -> list[mx.array]:
        return self.k + self.v


def _as_pool_rows(x: mx.array) -> mx.array:
    """[n, kv_heads, (1,) head_dim] rows -> the pool's [1, kv_heads, n, head_dim]."""
    return x.transpose(2, 1, 0, 3) if x.ndim == 4 else x.swapaxes(0, 1)[None]


def _as_head_rows(x: mx.array) -> mx.array:
    """[n, kv_heads, (1,) head_dim] rows -> [kv_heads, n, head_dim], a scatter's update."""
    return (x.reshape(x.shape[0], x.shape[1], x.shape[-1]) if x.ndim == 4 else x).swapaxes(0, 1)

