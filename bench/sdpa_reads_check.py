"""Does the engine's one-row read of the paged cache (attention.mlxlm_reads) give MLX's SDPA
the numbers of mlx-lm's own KVCache? Run on the GPU (on the CPU every line is "same").

Per KV length L and trial: the same K/V rows go into mlx-lm's KVCache (a prefill of L - 1
rows, then one decode row, as generate_step writes them) and into a PagedKVCache whose
blocks are consecutive or shuffled, with other rows' values in the rest of the pool. One
query row's SDPA over each: mlx-lm's reads (the reference), `mlxlm_reads` (a block gather
into a 256-step buffer), the previous copy (the pool's slice padded into such a buffer) and
the pool's slice as it is.

    python bench/sdpa_reads_check.py [--trials 3] [--out bench/results/cuda/sdpa_reads_check.json]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import common as C  # noqa: I001  (first: sys.path + BLAS before mlx)
from common import mx

from mlx_lm.models.cache import KVCache

from divergence.engine.kernels.attention import KV_STEP, mlxlm_reads
from divergence.engine.model.kv_cache import PagedKVCache
from divergence.engine.model.prepared import SeqAttention

LENGTHS = (64, 200, 255, 256, 257, 300, 511, 512, 513, 1000, 1024, 1500, 2049, 4000, 4096)
KV, HEADS, HD, BS = 2, 14, 64, 16
sdpa = mx.fast.scaled_dot_product_attention


def padded_copy(x):  # the engine's read before mlxlm_reads: the pool's slice padded into a buffer
    L = x.shape[2]
    if L % KV_STEP == 0:
        return mx.contiguous(x)
    return mx.pad(x, [(0, 0), (0, 0), (0, KV_STEP - L % KV_STEP), (0, 0)])[:, :, :L]


def one(L: int, shuffled: bool, seed: int) -> dict:
    mx.random.seed(seed)
    k = mx.random.normal((1, KV, L, HD)).astype(mx.bfloat16)
    v = mx.random.normal((1, KV, L, HD)).astype(mx.bfloat16)
    q = mx.random.normal((1, HEADS, 1, HD)).astype(mx.bfloat16)
    ref = KVCache()
    if L > 1:
        ref.update_and_fetch(k[:, :, : L - 1], v[:, :, : L - 1])
    rk, rv = ref.update_and_fetch(k[:, :, L - 1 :], v[:, :, L - 1 :])
    nb = -(-L // BS)
    blocks = 2 * nb + 2 * (KV_STEP // BS) + 2
    cache = PagedKVCache(1, blocks, BS, KV, HD, mx.bfloat16)
    cache.k[0] = mx.random.normal(cache.k[0].shape).astype(mx.bfloat16)  # other rows' values
    cache.v[0] = mx.random.normal(cache.v[0].shape).astype(mx.bfloat16)
    ids = [2 * b + 1 for b in range(nb)][::-1] if shuffled else list(range(1, 1 + nb))
    slots = mx.array([ids[p // BS] * BS + p % BS for p in range(L)], dtype=mx.int32)
    cache.write(0, slots, k[0].transpose(1, 0, 2), v[0].transpose(1, 0, 2))
    mx.eval(rk, rv, q, *cache.arrays())
    g = SeqAttention(0, 1, L, mx.array(ids, dtype=mx.int32), None if shuffled else ids[0] * BS, ids)
    want = sdpa(q, rk, rv, scale=HD ** -0.5)
    reads = {"mlxlm_reads": mlxlm_reads(g, 0, cache)}
    pk, pv = cache.gather(0, g.table, L, first_slot=g.first_slot)
    reads["padded copy"] = (padded_copy(pk), padded_copy(pv))
    reads["pool slice"] = (pk, pv)
    out = {}
    for name, (kk, vv) in reads.items():
        got = sdpa(q, kk, vv, scale=HD ** -0.5)
        out[name] = 0.0 if mx.array_equal(got, want).item() else mx.abs(got - want).max().item()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows, names = [], ("mlxlm_reads", "padded copy", "pool slice")
    for L in LENGTHS:
        for shuffled in (False, True):
            res = [one(L, shuffled, seed) for seed in range(a.trials)]
            worst = {n: max(r[n] for r in res) for n in names}
            same = {n: sum(r[n] == 0.0 for r in res) for n in names}
            rows.append(dict(length=L, blocks="shuffled" if shuffled else "consecutive", worst=worst, same=same))
            print(f"L {L:5d} {'shuffled   ' if shuffled else 'consecutive'}  "
                  + "  ".join(f"{n}: {same[n]}/{a.trials} same (max |d| {worst[n]:.3g})" for n in names), flush=True)
    bad = [r for r in rows if r["same"]["mlxlm_reads"] != a.trials]
    print(f"mlxlm_reads equals mlx-lm's KVCache reads in {len(rows) - len(bad)} of {len(rows)} (length, layout) cases"
          f" on {mx.default_device()}")
    if a.out:
        C.write_json(Path(a.out), dict(meta=C.meta(a), device=str(mx.default_device()), trials=a.trials, rows=rows))


if __name__ == "__main__":
    main()
