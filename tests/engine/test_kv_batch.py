"""A decode batch's K/V kept between steps (kernels/kv_batch.py) is a cache of the gather:
every event of a run, logits' bits and KV hashes included, is the same with it as
without, whatever the batch does between steps (requests join, finish, wait for blocks,
share prefix blocks, verify drafts, cross block boundaries, stop at EOS).

On the CPU the engine does not keep it (kv_batch.KEEP is None: GPU only); these tests
switch it on to run the same code the GPU runs; tests/test_cuda.py checks it there."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from divergence.core.request import Request
from divergence.engine.engine import Engine
from divergence.engine.kernels import kv_batch
from divergence.engine.kernels.kv_batch import DecodeBatchKv
from divergence.engine.model.kv_cache import PagedKVCache

from test_sampling import _Events  # (tests/engine is on sys.path: rootdir conftest)


@pytest.fixture
def keep(monkeypatch):
    def set_keep(on: bool):
        monkeypatch.setattr(kv_batch, "KEEP", on)
    return set_keep


def _run(target, draft, reqs, keep_on, keep, **kw):
    keep(keep_on)
    ob = _Events()
    eng = Engine(target, draft, observers=[ob], **kw)
    counts = []
    orig = eng._target_fwd.make_cache

    def make_cache(*a):  # (to read how many steps kept their K/V)
        c = orig(*a)
        counts.append(c.decode_batch.steps)
        return c

    eng._target_fwd.make_cache = make_cache
    res = eng.run(reqs, "concurrent")
    return ob.events, {k: o.tokens for k, o in res.outputs.items()}, counts


def _requests(target, prompts, n, max_tokens, arrivals, cut=None):
    out = []
    for i in range(n):
        toks = tuple(target.encode(prompts[i % len(prompts)]))
        if cut:
            toks = toks[: cut[i % len(cut)]]
        out.append(Request(f"r{i}", toks, max_tokens=max_tokens + 3 * i, arrival=arrivals[i % len(arrivals)]))
    return out


SCENARIOS = {
    # equal prompts that decode together (one slice update a step) and cross block boundaries
    "equal": dict(n=4, max_tokens=40, arrivals=(0,), cut=(9,), kw={}),
    # unequal lengths (a scatter a step), joining and finishing at different steps
    "staggered": dict(n=5, max_tokens=24, arrivals=(0, 0, 2, 7, 11), kw={}),
    # a small cache: requests wait for memory, and reuse the blocks of those that finished
    "waiting": dict(n=6, max_tokens=20, arrivals=(0,), cut=(8, 6, 7), kw=dict(num_blocks=24, block_size=4)),
    # shared prefix blocks
    "prefix": dict(n=4, max_tokens=20, arrivals=(0, 0, 3, 3), kw=dict(prefix_caching=True, block_size=4)),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_kept_batch_changes_no_event(target, prompts, keep, name):
    sc = SCENARIOS[name]
    reqs = _requests(target, prompts, sc["n"], sc["max_tokens"], sc["arrivals"], sc.get("cut"))
    kw = dict(stop_at_eos=False, **sc["kw"])
    base, toks, _ = _run(target, None, reqs, False, keep, **kw)
    kept, toks2, counts = _run(target, None, reqs, True, keep, **kw)
    assert toks2 == toks
    assert kept == base
    steps = counts[0]
    assert steps["kept"] > steps["gathered"] > 0, steps  # the kept arrays were read, and rebuilt


def test_kept_batch_under_speculative_decoding(target, draft, prompts, keep):
    reqs = _requests(target, prompts, 4, 16, (0, 0, 1, 3))
    kw = dict(stop_at_eos=False, spec_k=3)
    base, toks, _ = _run(target, draft, reqs, False, keep, **kw)
    kept, toks2, _ = _run(target, draft, reqs, True, keep, **kw)
    assert toks2 == toks and kept == base


def test_kept_batch_with_eos_mid_run(target, prompts, keep):
    reqs = _requests(target, prompts, 4, 12, (0, 0, 1, 3))
    _, toks, _ = _run(target, None, reqs, False, keep, stop_at_eos=False)
    eng_eos = {toks["r1"][4]}
    runs = []
    for on in (False, True):
        keep(on)
        ob = _Events()
        eng = Engine(target, None, observers=[ob])
        eng.eos_ids = set(eng_eos)
        eng.run(reqs, "concurrent")
        runs.append(ob.events)
    assert runs[0] == runs[1]
    assert any(ev[0] == "request" and ev[4] == "eos" for ev in runs[1])


def _cache(layers=2, blocks=16, bs=4, kv=2, hd=8):
    c = PagedKVCache(layers, blocks, bs, kv, hd, mx.float32)
    rng = np.random.default_rng(0)
    for li in range(layers):
        c.k[li] = mx.array(rng.standard_normal(c.k[li].shape).astype(np.float32))
        c.v[li] = mx.array(rng.standard_normal(c.v[li].shape).astype(np.float32))
    return c


def test_what_invalidates_the_kept_arrays():
    kept = DecodeBatchKv(layers=1, block_size=4)

    def step(tables, lengths):
        kept.begin(tables, lengths)
        if not kept.extending:
            x = mx.zeros((len(tables), 1, kept.rows, 4))
            kept.keep(0, x, x)
        return kept.extending

    t2 = [[0, 1, 2], [3, 4, 5]]
    assert not step(t2, [5, 9])  # first: gathered
    assert step(t2, [6, 10])  # each grew by one row: kept
    assert not step(t2, [7, 12])  # one grew by two (a step in between wrote it)
    assert not step(t2, [8, 13])  # the longest needs a fourth block: a wider layout
    t3 = [[0, 1, 2, 6], [3, 4, 5, 7], [8]]
    assert not step(t3, [9, 14, 2])  # another sequence joined
    assert step(t3, [10, 15, 3])
    assert not step([[0, 1, 2, 6], [3, 9, 5, 7], [8]], [11, 16, 4])  # a block changed
    kept.begin(None, [12])  # a step that is not a batched decode step: dropped
    assert kept.tables is None and kept.arrays() == []
    assert not step([[0, 1, 2, 6], [3, 9, 5, 7], [8, 10]], [12, 16, 5])
    assert kept.steps == {"kept": 2, "gathered": 6}


@pytest.mark.parametrize("equal", [True, False])
def test_kept_arrays_hold_the_pool_rows(equal, keep):
    """After steps that write one row per sequence, the kept arrays equal a fresh gather."""
    keep(True)
    c = _cache()
    tables = [[3, 4, 5], [9, 1, 2]]
    lengths = [9, 9] if equal else [6, 9]  # (three more rows stay in three blocks)
    tab = mx.array([t for t in tables], dtype=mx.int32)
    c.decode_batch.begin(tables, lengths)
    for li in range(2):
        c.decode_batch.keep(li, *c.gather_blocks(li, tab))
    rng = np.random.default_rng(1)
    for _ in range(3):
        lengths = [n + 1 for n in lengths]
        c.decode_batch.begin(tables, lengths)
        assert c.decode_batch.extending
        slots = mx.array([t[(n - 1) // 4] * 4 + (n - 1) % 4 for t, n in zip(tables, lengths)], dtype=mx.int32)
        for li in range(2):
            kr = mx.array(rng.standard_normal((2, 2, 1, 8)).astype(np.float32))
            vr = mx.array(rng.standard_normal((2, 2, 8)).astype(np.float32))
            c.write(li, slots, kr, vr)
    for li in range(2):
        want = c.gather_batch(li, tab, max(lengths))
        got = c.decode_batch.read(li, max(lengths))
        for w, g in zip(want, got):
            for b, n in enumerate(lengths):
                np.testing.assert_array_equal(np.array(g[b, :, :n]), np.array(w[b, :, :n]))
