"""What reading a batch's K/V out of the paged pool costs a decode step, against the SDPA
that reads them, and other ways of reading the same rows (issue 33: on the H200 the
engine's B=8 step grows from 6.3 to 10.7 ms between 128 and 4,096 positions while
BatchGenerator's, which keeps each batch contiguous, grows 7.6 to 8.8 ms).

Per (B, L), one step's worth of reads of the 0.5B shape (24 layers, 2 KV heads of 64,
bf16), each sequence's blocks consecutive in the pool (as a batch of prompts admitted
together gets them) or shuffled. Timed (median of --reps, ms per step, evaluated each
step):

* `block gather`: the engine's read today (kv_reads.gather_batch: one gather of whole
  blocks per pool), then the unmasked SDPA over it;
* `slices`: each sequence's consecutive blocks as a slice of the pool, concatenated
  (consecutive tables only);
* `contiguous`: SDPA over a [B, kv, L, hd] array that needs no read (BatchGenerator's
  buffer): the floor, and the second half of `block gather`;
* `gather only`: the first half of `block gather` (kv_reads.as_words: 8-byte words);
* `element gather`: the same gather indexing bf16 elements (the read before as_words);

    python bench/kv_read_cost.py [--reps 20] [--out bench/results/cuda/kv_read_cost.json]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import common as C  # noqa: I001  (first: sys.path + BLAS before mlx)
from common import mx

from divergence.engine.model.kv_cache import PagedKVCache

LAYERS, KV, HEADS, HD, BS = 24, 2, 14, 64, 16
sdpa = mx.fast.scaled_dot_product_attention


def timed(fn, reps: int) -> float:
    for _ in range(3):
        mx.eval(fn())
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t)
    return C.med(ts) * 1000


def point(B: int, L: int, shuffled: bool, reps: int) -> dict:
    nb = -(-L // BS)
    cache = PagedKVCache(LAYERS, B * nb + 1, BS, KV, HD, mx.bfloat16)
    ids = [[s * nb + b for b in range(nb)] for s in range(B)]
    if shuffled:
        ids = [[b * B + s for b in range(nb)] for s in range(B)]
    tables = mx.array(ids, dtype=mx.int32)
    q = mx.random.normal((B, HEADS, 1, HD)).astype(mx.bfloat16)
    dense = [(mx.random.normal((B, KV, L, HD)).astype(mx.bfloat16),) * 2 for _ in range(LAYERS)]
    mx.eval(q, tables, dense)

    def gathered():
        return [cache.gather_batch(li, tables, L) for li in range(LAYERS)]

    def block_gather():
        return [sdpa(q, k, v, scale=0.125) for k, v in gathered()]

    def gather_only():
        return [x for kv in gathered() for x in kv]

    def element_gather():  # the read before kv_reads.as_words: the gather indexes bf16 elements
        idx = cache._head_base + tables[:, None, :]
        out = []
        for li in range(LAYERS):
            for pool in (cache.k[li], cache.v[li]):
                g = pool.reshape(KV * cache.num_blocks, BS, HD)[idx]
                out.append(g.reshape(B, KV, -1, HD)[:, :, :L])
        return out

    def contiguous():
        return [sdpa(q, k, v, scale=0.125) for k, v in dense]

    def slices():
        out = []
        for li in range(LAYERS):
            k, v = cache.k[li], cache.v[li]
            ks = mx.concatenate([k[:, :, t[0] * BS : t[0] * BS + L] for t in ids])
            vs = mx.concatenate([v[:, :, t[0] * BS : t[0] * BS + L] for t in ids])
            out.append(sdpa(q, ks, vs, scale=0.125))
        return out

    row = dict(B=B, L=L, blocks="shuffled" if shuffled else "consecutive",
               ms={"block gather": timed(block_gather, reps), "gather only": timed(gather_only, reps),
                   "element gather": timed(element_gather, reps),
                   "contiguous": timed(contiguous, reps)})
    if not shuffled:
        row["ms"]["slices"] = timed(slices, reps)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    pts = [(8, 128), (8, 1024), (8, 4096), (32, 512), (64, 512)] if not a.quick else [(4, 128)]
    rows = []
    for B, L in pts:
        for shuffled in (False, True):
            r = point(B, L, shuffled, a.reps)
            rows.append(r)
            print(f"B {B:3d} L {L:5d} {r['blocks']:11s} " + "  ".join(f"{k} {v:.3f}" for k, v in r["ms"].items()),
                  flush=True)
    if a.out:
        C.write_json(Path(a.out), dict(meta=C.meta(a), device=str(mx.default_device()), rows=rows))


if __name__ == "__main__":
    main()
