"""Paged KV cache: blocks come and go without leaks, writes are in place."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from divergence.engine.model.kv_cache import PagedKVCache
from divergence.engine.sched.blocks import BlockManager, CacheFullError


def test_allocate_free_no_leak():
    bm = BlockManager(10, 4)
    bm.allocate("a", 9)  # 3 blocks
    bm.allocate("b", 16)  # 4 blocks
    assert bm.in_use == 7 and bm.num_free == 3
    assert not bm.can_allocate("c", 13)
    with pytest.raises(CacheFullError):
        bm.allocate("c", 13)
    bm.free("a")
    assert bm.can_allocate("c", 13)
    bm.allocate("c", 13)
    bm.free("b")
    bm.free("c")
    assert bm.in_use == 0 and bm.num_free == 10


def test_slots_follow_the_block_table():
    bm = BlockManager(8, 4)
    bm.allocate("x", 4)
    bm.allocate("a", 10)  # blocks 1, 2, 3
    assert bm.tables["a"] == [1, 2, 3]
    np.testing.assert_array_equal(bm.slots("a", 3, 6), [7, 8, 9])


def test_prefix_blocks_are_shared_and_evicted_last():
    bm = BlockManager(6, 4, prefix_caching=True)
    prompt = list(range(13))  # 3 full blocks + 1
    assert bm.match_prefix("a", prompt) == 0
    bm.allocate("a", 16)
    bm.register_prefix("a", prompt, 13)
    assert len(bm.by_hash) == 3
    # b shares the first 2 blocks (8 tokens) and differs after
    other = prompt[:8] + [99] * 5
    assert bm.match_prefix("b", other) == 8
    assert bm.tables["b"] == bm.tables["a"][:2]
    assert all(bm.ref[blk] == 2 for blk in bm.tables["a"][:2])
    bm.free("a")
    bm.free("b")
    assert bm.in_use == 0
    # cached blocks survive (evictable) and are found again
    assert bm.match_prefix("c", prompt) == 12
    bm.free("c")
    # memory pressure evicts them
    bm.allocate("d", 24)
    assert bm.in_use == 6 and not bm.by_hash


@pytest.mark.parametrize("by_slice", [False, True], ids=["scatter", "slice-update"])
def test_write_is_in_place_not_a_whole_cache_copy(by_slice):
    blocks, bs, kv, hd = 2048, 16, 4, 64
    cache = PagedKVCache(1, blocks, bs, kv, hd, mx.float32)
    pool_bytes = blocks * bs * kv * hd * 4  # 32 MiB per pool
    slots = mx.array(np.array([5], dtype=np.int32))
    # the slice path as the forward calls it: rows in RoPE's [n, kv, 1, hd] layout
    row = mx.ones((1, kv, 1, hd) if by_slice else (1, kv, hd), mx.float32)
    cache.write(0, slots, row, row, start=5 if by_slice else None)
    mx.eval(cache.arrays())
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    for i in range(20):
        cache.write(0, mx.array(np.array([i], dtype=np.int32)), row * i, row * i, start=i if by_slice else None)
        mx.eval(cache.arrays())
    grew = mx.get_peak_memory() - before
    assert grew < pool_bytes // 4, f"writing 20 single tokens allocated {grew} bytes (a pool is {pool_bytes})"
    k, _ = cache.read(0, mx.array(np.array([3, 19], dtype=np.int32)))
    np.testing.assert_array_equal(np.asarray(k)[:, 0, 0], [3, 19])


@pytest.mark.parametrize("rope_layout", [False, True], ids=["rows", "rope-layout"])
def test_writes_land_in_their_slots_by_scatter_and_by_slice(rope_layout):
    """Both write paths, from [n, kv, hd] rows or the forward's [n, kv, 1, hd], against a
    numpy pool: every written slot holds its row, every other slot stays zero."""
    bs, kv, hd = 4, 2, 8
    cache = PagedKVCache(1, 6, bs, kv, hd, mx.float32)
    want = np.zeros((kv, cache.num_blocks * bs, hd), np.float32)
    rng = np.random.default_rng(1)
    for slots, start in (([2, 9, 13, 22], None), ([5, 6, 7, 8, 9], 5), ([0], 0), ([17], None)):
        rows = rng.standard_normal((len(slots), kv, hd)).astype(np.float32)
        x = mx.array(rows[:, :, None] if rope_layout else rows)
        cache.write(0, mx.array(np.array(slots, np.int32)), x, -x, start=start)
        want[:, slots] = rows.swapaxes(0, 1)
    mx.eval(cache.arrays())
    np.testing.assert_array_equal(np.asarray(cache.k[0])[0], want)
    np.testing.assert_array_equal(np.asarray(cache.v[0])[0], -want)
    k, v = cache.gather(0, mx.array([1, 2], dtype=mx.int32), 7)  # by block: slots 4..10
    np.testing.assert_array_equal(np.asarray(k)[0], want[:, 4:11])
    k, _ = cache.gather(0, None, 6, first_slot=4)  # consecutive blocks: a slice of the pool
    np.testing.assert_array_equal(np.asarray(k)[0], want[:, 4:10])
