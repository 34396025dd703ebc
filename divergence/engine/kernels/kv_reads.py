"""How attention reads K/V from the paged cache, once for the whole cache and for a slice of
its KV heads (attention run in head groups, dispatch._by_heads, hands each group a
HeadSlice). Here, below model/: the cache (model/kv_cache.py) is built there and inherits
these reads; kernels/ reads it and never imports model/."""
from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:
    from ..model.kv_cache import PagedKVCache


def as_words(x: mx.array) -> mx.array:
    """x's last axis read as 8-byte words where its rows allow (4-byte otherwise): a gather
    moves the same bytes (the values are not touched, so the bits are the same), with 4x
    fewer elements to index in bf16. MLX CUDA's gather runs one thread per element, so at
    long contexts the block gather, not SDPA, was most of a batched decode step's cost
    (docs/performance.md, the context bench)."""
    row = x.shape[-1] * x.dtype.size
    for word in (mx.uint64, mx.uint32):
        if row % word.size == 0 and word.size > x.dtype.size:
            return x.view(word)
    return x


class KvReads:
    """The reads of a head-major pool per layer, [1, kv_heads, num_blocks * block_size,
    head_dim]. A subclass gives `_pools(layer)` (K, V), the geometry (kv_heads, head_dim,
    num_blocks, block_size) and `_head_base` ([1, kv_heads, 1]: each head's first block
    in the pool viewed as [kv_heads * blocks, block_size, head_dim])."""

    kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int
    _head_base: mx.array
    _flat: tuple = (None, None)  # (tables, their flat index): made once per step, used by every layer

    def _pools(self, layer: int) -> tuple[mx.array, mx.array]:
        raise NotImplementedError

    def gather(self, layer: int, table: mx.array, length: int, *, first_slot: int | None = None
               ) -> tuple[mx.array, mx.array]:
        """One sequence's first `length` positions, [1, kv_heads, length, head_dim], read by
        block (`table`: its block ids, at least ceil(length / block_size) of them), or, when
        its blocks are consecutive from `first_slot`, as a slice of the pool (no copy, as
        mlx-lm's own cache is read)."""
        if first_slot is not None:
            end = first_slot + length
            k, v = self._pools(layer)
            return k[:, :, first_slot:end], v[:, :, first_slot:end]
        out = []
        kv, hd = self.kv_heads, self.head_dim
        for pool in self._pools(layer):
            g = pool.reshape(kv, self.num_blocks, self.block_size, hd)[:, table].reshape(1, kv, -1, hd)
            out.append(g if g.shape[2] == length else g[:, :, :length])
        return out[0], out[1]

    def gather_batch(self, layer: int, tables: mx.array, length: int) -> tuple[mx.array, mx.array]:
        """Several sequences at once, [B, kv_heads, length, head_dim]: `tables` [B, nb] of
        block ids (rows padded with any valid block), positions past a sequence's own
        length are someone else's or stale, and must be masked by the caller."""
        if self._flat[0] is not tables:
            self._flat = (tables, self._head_base + tables[:, None, :])  # [B, kv, nb]
        idx = self._flat[1]
        out = []
        kv, hd = self.kv_heads, self.head_dim
        for pool in self._pools(layer):
            blocks = pool.reshape(kv * self.num_blocks, self.block_size, hd)
            g = as_words(blocks)[idx]  # [B, kv, nb, bs, hd'] in words
            g = g.view(pool.dtype).reshape(g.shape[0], kv, -1, hd)
            out.append(g if g.shape[2] == length else g[:, :, :length])
        return out[0], out[1]

    def gather_positions(self, layer: int, slots: mx.array, batch: int, length: int) -> tuple[mx.array, mx.array]:
        """[B, kv_heads, length, head_dim] read slot by slot (`slots`: [B * length] pool slots)."""
        out = []
        kv, hd = self.kv_heads, self.head_dim
        for pool in self._pools(layer):
            out.append(pool[0][:, slots].reshape(kv, batch, length, hd).transpose(1, 0, 2, 3))
        return out[0], out[1]


class HeadSlice(KvReads):
    """KV heads [h0, h1) of a PagedKVCache, read the way the cache reads all of them (the
    attention kernels take either): the same values, [.., h1 - h0, L, head_dim]. Attention
    of different KV heads is independent (each query head reads one KV head), so a step's
    attention can run one head group per CPU stream (kernels.dispatch.HEAD_SPLIT)."""

    def __init__(self, cache: PagedKVCache, h0: int, h1: int):
        self.cache, self.h0, self.h1 = cache, h0, h1
        self.kv_heads, self.head_dim = h1 - h0, cache.head_dim
        self.block_size, self.num_blocks = cache.block_size, cache.num_blocks
        self._head_base = cache._head_base[:, h0:h1] - h0 * cache.num_blocks  # from this slice's head 0
        self._flat = (None, None)

    def _pools(self, layer: int) -> tuple[mx.array, mx.array]:
        c = self.cache
        return c.k[layer][:, self.h0 : self.h1], c.v[layer][:, self.h0 : self.h1]
