"""The KV hashes a trace stores: xxh3_64 of each position's exact bytes, whatever the
array's dtype, shape, byte order or memory layout, and per (layer, position) for a step."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import xxhash

from divergence.core.hashing import hash_rows
from divergence.engine.kv_events import kv_hashes


def reference(arr: np.ndarray) -> np.ndarray:
    """One xxh3 per row of the row's little-endian bytes, written out plainly."""
    le = arr.astype(arr.dtype.newbyteorder("<"))
    return np.array([xxhash.xxh3_64_intdigest(np.ascontiguousarray(le[i]).tobytes()) for i in range(len(arr))],
                    dtype=np.uint64)


@pytest.mark.parametrize("dtype", ["uint8", "<u2", "float16", "float32", ">f4", "uint32", "float64", "int64"])
@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (33, 2, 64), (16, 128), (5, 4, 80), (3, 1031)])
def test_hash_rows_is_xxh3_of_each_row(dtype, shape):
    rng = np.random.default_rng(abs(hash((dtype, shape))) % 2**32)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
    arr = raw.view(dtype).reshape(shape)
    got = hash_rows(arr)
    assert got.dtype == np.uint64 and got.shape == (shape[0],)
    assert np.array_equal(got, reference(arr))


def test_hash_rows_of_a_strided_view_hashes_its_values():
    arr = np.random.default_rng(1).standard_normal((12, 40)).astype(np.float32)
    view = arr[::2, ::3]
    assert not view.flags.c_contiguous
    assert np.array_equal(hash_rows(view), reference(np.ascontiguousarray(view)))


def test_hash_rows_of_no_rows():
    assert hash_rows(np.zeros((0, 16), np.float32)).shape == (0,)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_step_hashes_are_per_layer_and_position(dtype):
    layers, t, kv_heads, head_dim = 3, 5, 2, 64
    k = mx.random.normal((layers, t, kv_heads, head_dim), key=mx.random.key(0)).astype(dtype)
    v = mx.random.normal((layers, t, kv_heads, head_dim), key=mx.random.key(1)).astype(dtype)
    kh, vh = kv_hashes(k, v)
    assert kh.shape == vh.shape == (layers, t)
    for a, h in ((k, kh), (v, vh)):
        raw = np.array(a.view(mx.uint16 if dtype != mx.float32 else mx.uint32))
        for layer in range(layers):
            for pos in range(t):
                assert int(h[layer, pos]) == xxhash.xxh3_64_intdigest(raw[layer, pos].tobytes())


def _plan(index: int, counts: list[int]):
    from divergence.core.events import DECODE, PREFILL, SeqSlice, StepPlan

    slices, row = [], 0
    for i, n in enumerate(counts):
        slices.append(SeqSlice(f"r{i}", PREFILL if n > 1 else DECODE, 10 * i, n, row, tuple(range(n))))
        row += n
    return StepPlan(index, "target", tuple(slices))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("counts", [[1] * 6, [1] * 6, [1, 1, 1], [3, 1, 2], [4]])
@pytest.mark.parametrize("strided", [False, True])
def test_step_writes_hash_each_slice_layer_position(dtype, counts, strided):
    """kv_writes' hashes, write by write (slice, then layer, then position), are the plain
    xxh3 of each stored row, for decode steps (whose byte ranges are kept per shape: the
    repeated [1] * 6 runs them again from the kept ranges) and mixed ones, from contiguous
    and strided K/V."""
    from divergence.engine.kv_events import kv_writes

    layers, T, kv_heads, head_dim = 3, sum(counts), 2, 32
    shape = (layers, T, kv_heads, head_dim * (2 if strided else 1))
    k = mx.random.normal(shape, key=mx.random.key(T)).astype(dtype)
    v = mx.random.normal(shape, key=mx.random.key(T + 1)).astype(dtype)
    if strided:
        k, v = k[..., ::2], v[..., ::2]
    writes = kv_writes(_plan(7, counts), "target", k, v).events()
    assert len(writes) == len(counts) * layers
    word = mx.uint16 if dtype != mx.float32 else mx.uint32
    raw_k, raw_v = (np.array(mx.contiguous(a).view(word)) for a in (k, v))
    row = np.cumsum([0] + counts)
    for w in writes:
        i = int(w.request_id[1:])
        assert (w.start, w.count) == (10 * i, counts[i])
        for j in range(w.count):
            for raw, h in ((raw_k, w.k_hashes), (raw_v, w.v_hashes)):
                assert int(h[j]) == xxhash.xxh3_64_intdigest(raw[w.layer, row[i] + j].tobytes())


@pytest.mark.parametrize("counts", [[1] * 4, [2, 1, 3]])
def test_step_writes_hash_k_and_v_rows_of_their_own_width(counts):
    """K and V rows need not be as wide (a model whose values have another head dim): each
    array's hashes are of its own rows."""
    from divergence.engine.kv_events import kv_writes

    layers, T = 2, sum(counts)
    k = mx.random.normal((layers, T, 2, 32), key=mx.random.key(5))
    v = mx.random.normal((layers, T, 2, 16), key=mx.random.key(6))
    writes = kv_writes(_plan(1, counts), "target", k, v).events()
    raw_k, raw_v = np.array(k.view(mx.uint32)), np.array(v.view(mx.uint32))
    row = np.cumsum([0] + counts)
    for w in writes:
        i = int(w.request_id[1:])
        for j in range(w.count):
            assert int(w.k_hashes[j]) == xxhash.xxh3_64_intdigest(raw_k[w.layer, row[i] + j].tobytes())
            assert int(w.v_hashes[j]) == xxhash.xxh3_64_intdigest(raw_v[w.layer, row[i] + j].tobytes())


def test_step_with_no_rows_hashes_nothing():
    """A step that wrote no positions (T = 0) has [layers, 0] hashes, not an error."""
    k = mx.zeros((3, 0, 2, 64), dtype=mx.bfloat16)
    kh, vh = kv_hashes(k, k)
    assert kh.shape == vh.shape == (3, 0) and kh.dtype == np.uint64
