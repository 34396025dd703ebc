"""A KV-head slice of the paged cache, read as the cache is: attention run in KV head groups
(dispatch._by_heads) hands each group one. Here, not in model/kv_cache.py: kernels/ may not
import model/ (the cache is read, never built, here)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:
    from ..model.kv_cache import PagedKVCache


class HeadSlice:
    """KV heads [h0, h1) of a PagedKVCache, read the way the cache reads all of them (the
    attention kernels take either): the same values, [.., h1 - h0, L, head_dim]. Attention
    of different KV heads is independent (each query head reads one KV head), so a step's
    attention can run one head group per CPU stream (kernels.dispatch.HEAD_SPLIT)."""

    def __init__(self, cache: PagedKVCache, h0: int, h1: int):
        self.cache, self.h0, self.h1 = cache, h0, h1
        self.kv_heads, self.head_dim = h1 - h0, cache.head_dim
        self.block_size, self.num_blocks = cache.block_size, cache.num_blocks
        self._flat: tuple = (None, None)

    def _pools(self, layer: int) -> tuple[mx.array, mx.array]:
        c = self.cache
        return c.k[layer][:, self.h0 : self.h1], c.v[layer][:, self.h0 : self.h1]

    def gather(self, layer: int, table: mx.array, length: int, *, first_slot: int | None = None
               ) -> tuple[mx.array, mx.array]:
        if first_slot is not None:
            end = first_slot + length
            return tuple(p[:, :, first_slot:end] for p in self._pools(layer))
        out = []
        kv, hd, c = self.kv_heads, self.head_dim, self.cache
        for pool in self._pools(layer):
            g = pool.reshape(kv, c.num_blocks, c.block_size, hd)[:, table].reshape(1, kv, -1, hd)
            out.append(g if g.shape[2] == length else g[:, :, :length])
        return out[0], out[1]

    def gather_batch(self, layer: int, tables: mx.array, length: int) -> tuple[mx.array, mx.array]:
        c = self.cache
        if self._flat[0] is not tables:
            base = c._head_base[:, self.h0 : self.h1] - self.h0 * c.num_blocks  # [1, kv, 1], from this slice's 0
            self._flat = (tables, base + tables[:, None, :])
        idx = self._flat[1]
        out = []
        kv, hd = self.kv_heads, self.head_dim
        for pool in self._pools(layer):
            g = pool.reshape(kv * c.num_blocks, c.block_size, hd)[idx]  # [B, kv, nb, bs, hd]
            g = g.reshape(g.shape[0], kv, -1, hd)
            out.append(g if g.shape[2] == length else g[:, :, :length])
        return out[0], out[1]

    def gather_positions(self, layer: int, slots: mx.array, batch: int, length: int) -> tuple[mx.array, mx.array]:
        out = []
        kv, hd = self.kv_heads, self.head_dim
        for pool in self._pools(layer):
            out.append(pool[0][:, slots].reshape(kv, batch, length, hd).transpose(1, 0, 2, 3))
        return out[0], out[1]
