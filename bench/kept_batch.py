"""What keeping a decode batch's K/V between steps (kernels/kv_batch.py) buys a step, and
that it changes no bit (issue 33: on the H200 the engine's B >= 8 step grew with the
context, where BatchGenerator's, whose cache is its batch, barely does).

Per (B, context) point, interleaved and order-rotated each repetition: B requests with
prompts `context` tokens long decode `--tokens` tokens under the engine with its K/V
gathered every step (kv_batch.KEEP = False, the read before), with the kept batch
(KEEP = True) and under mlx-lm's BatchGenerator. Reported: ms per generated token (from
the median step interval), the paired ratios, and whether the kept run's tokens and
every top-k logit are bit for bit the gathered run's (they must be: the kept arrays are
the gathered ones, updated in place).

    python bench/kept_batch.py --models qwen0.5b --dtypes stored        # on the GPU
    python bench/kept_batch.py --quick                                  # the fixture, CPU

Writes bench/results/kept_batch.json (--quick: a temp dir).
"""
from __future__ import annotations

import argparse

import common as C  # noqa: I001  (first: sys.path + BLAS before mlx)
from common import mx  # noqa: F401

import numpy as np

import bench_engine as E
from divergence.core.events import Observer
from divergence.engine.engine import Engine
from divergence.engine.kernels import kv_batch

FULL = dict(points=((8, 128), (8, 1024), (8, 4096), (32, 512), (64, 512)), tokens=48, reps=5)
QUICK = dict(points=((4, 32), (4, 128)), tokens=24, reps=3)


class TopK(Observer):
    """Every token's id and top-k logits' bits, in event order."""

    def __init__(self):
        self.rows = []

    def on_token(self, t):
        self.rows.append((t.request_id, t.position, t.token, t.topk_logits.view(np.uint32).tobytes()))


def engine_run(eng, clock, topk, prompts, n, keep: bool) -> dict:
    kv_batch.KEEP = keep
    topk.rows = []
    try:
        r = E.engine_batch(eng, clock, prompts, n)
    finally:
        kv_batch.KEEP = None
    r["topk"] = list(topk.rows)
    return r


def op_check(B: int, L: int, steps: int = 12, seed: int = 0) -> dict:
    """One layer of the 0.5B shape's attention (bf16), B sequences from L positions: after
    each step's rows are written, are the kept K/V the gathered ones bit for bit, and does
    SDPA give the same bits over both (and over a second gather: is the gather's own
    reading repeatable)?"""
    from divergence.engine.model.kv_cache import PagedKVCache

    bs, kv, heads, hd = 16, 2, 14, 64
    nb = -(-(L + steps) // bs)
    cache = PagedKVCache(1, B * nb, bs, kv, hd, mx.bfloat16)
    key = mx.random.key(seed)
    cache.k[0] = mx.random.normal(cache.k[0].shape, key=key).astype(mx.bfloat16)
    cache.v[0] = mx.random.normal(cache.v[0].shape, key=mx.random.split(key)[0]).astype(mx.bfloat16)
    tables = [[s * nb + b for b in range(nb)] for s in range(B)]
    q = mx.random.normal((B, heads, 1, hd)).astype(mx.bfloat16)
    kv_batch.KEEP = True
    out = {"steps": 0, "kv_equal": 0, "sdpa_equal": 0, "gather_repeatable": 0}
    try:
        n = L
        for step in range(steps + 1):
            need = -(-n // bs)
            cache.begin_step(_Prep([t[:need] for t in tables], [n] * B))
            if step:
                slots = mx.array([t[(n - 1) // bs] * bs + (n - 1) % bs for t in tables], dtype=mx.int32)
                rows = mx.random.normal((2, B, kv, 1, hd)).astype(mx.bfloat16)
                cache.write(0, slots, rows[0], rows[1])
            tab = mx.array([t[:need] for t in tables], dtype=mx.int32)
            kept = cache.decode_batch.read(0, n)
            if kept is None:
                cache.decode_batch.keep(0, *cache.gather_blocks(0, tab))
                kept = cache.decode_batch.read(0, n)
            else:
                out["steps"] += 1
                g1, g2 = cache.gather_batch(0, tab, n), cache.gather_batch(0, tab, n)
                o = [mx.fast.scaled_dot_product_attention(q, k, v, scale=hd ** -0.5) for k, v in (kept, g1, g2)]
                mx.eval(kept, g1, g2, o)
                out["kv_equal"] += all(np.array_equal(np.array(a.view(mx.uint16)), np.array(b.view(mx.uint16)))
                                       for a, b in zip(kept, g1))
                ob = [np.array(x.view(mx.uint16)) for x in o]
                out["sdpa_equal"] += np.array_equal(ob[0], ob[1])
                out["gather_repeatable"] += np.array_equal(ob[1], ob[2])
            mx.eval(cache.arrays())
            n += 1
    finally:
        kv_batch.KEEP = None
    return out


class _Prep:
    """The two things PagedKVCache.begin_step reads of a prepared step."""

    def __init__(self, tables, lengths):
        self.groups = [type("G", (), {"host_tables": tuple(tables)})()]
        self.kv_lens = tuple(lengths)


def _bits(run: dict):
    return run["tokens"], run["topk"]


def bench_model(name: str, path, dtype, sz: dict) -> dict:
    t = C.load(path, dtype)
    print(f"\n== {name} {t.dtype}", flush=True)
    pts = sz["points"]
    bmax, longest = max(b for b, _ in pts), max(c for _, c in pts)
    prompts = {c: C.prompts(t.encode, bmax, c) for c in {c for _, c in pts}}
    clock, topk = C.Clock(), TopK()
    eng = Engine(t, policy="native", stop_at_eos=False, token_budget=max(4096, longest * bmax),
                 observers=[clock, topk], prefill="mlx-lm")
    N = sz["tokens"]
    jobs = {
        "gathered": lambda ps: engine_run(eng, clock, topk, ps, N, False),
        "kept": lambda ps: engine_run(eng, clock, topk, ps, N, True),
        "mlx_lm": lambda ps: E.mlx_batch(t.model, ps, N),
    }
    for b, c in pts:  # warm-up: on MLX CUDA the first run of a shape compiles kernels
        for fn in jobs.values():
            fn(prompts[c][:b])
    runs = {p: {k: [] for k in jobs} for p in pts}
    order = list(jobs)
    for rep in range(sz["reps"]):
        order = order[1:] + order[:1]
        for b, c in pts:
            for who in order:
                runs[(b, c)][who].append(jobs[who](prompts[c][:b]))
        print(f"   rep {rep + 1}/{sz['reps']} done", flush=True)
    grid = []
    for (b, c), r in runs.items():
        rate = {k: [x["decode_tok_s"] for x in v] for k, v in r.items()}
        same = all(_bits(k) == _bits(g) for k, g in zip(r["kept"], r["gathered"]))
        # each way against its own first repetition: is the engine's run repeatable at all here?
        again = {w: all(_bits(x) == _bits(r[w][0]) for x in r[w][1:]) for w in ("gathered", "kept")}
        grid.append({"batch": b, "context": c, "tokens": N,
                     "ms_per_token": {k: 1000 / C.med(v) for k, v in rate.items()},
                     "kept_vs_gathered": C.paired_ratio(rate["kept"], rate["gathered"]),
                     "kept_vs_mlx_lm": C.paired_ratio(rate["kept"], rate["mlx_lm"]),
                     "gathered_vs_mlx_lm": C.paired_ratio(rate["gathered"], rate["mlx_lm"]),
                     "kept_bits_equal_gathered": same,
                     "repeatable": again,
                     "peak_mb": {k: C.med([x["peak_mb"] for x in v]) for k, v in r.items()}})
    return {"model": name, "dtype": t.dtype, "grid": grid}


def print_table(results: list[dict]) -> str:
    rows = []
    for r in results:
        for g in r["grid"]:
            ms = g["ms_per_token"]
            rows.append([r["model"], r["dtype"], g["batch"], g["context"], C.fmt(ms["gathered"], 3),
                         C.fmt(ms["kept"], 3), C.fmt(ms["mlx_lm"], 3), C.fmt(g["kept_vs_gathered"]),
                         C.fmt(g["gathered_vs_mlx_lm"]), C.fmt(g["kept_vs_mlx_lm"]), g["kept_bits_equal_gathered"],
                         g["repeatable"]["gathered"], g["repeatable"]["kept"]])
    txt = C.table(rows, ["model", "dtype", "B", "context", "gathered ms/tok", "kept ms/tok", "mlx-lm ms/tok",
                         "kept/gathered", "gathered/mlx-lm", "kept/mlx-lm", "same bits", "gathered again",
                         "kept again"])
    print("\n" + txt)
    return txt


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=None, help="comma list (default qwen0.5b; --quick: fixture)")
    ap.add_argument("--dtypes", default=None, help="comma list: float32, bfloat16, stored (default bfloat16)")
    ap.add_argument("--quick", action="store_true", help="the fixture, small sizes (a minute on a CPU)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--points", default=None, help="B:context,... (default 8:128,8:1024,8:4096,32:512,64:512)")
    ap.add_argument("--op-check", action="store_true", help="first the one-layer check of kept vs gathered reads")
    ap.add_argument("--model-cache", default=None, help="where the random qwen0.5b model is generated/reused")
    ap.add_argument("--out", default=None, help="default bench/results/kept_batch.json (--quick: a temp dir)")
    args = ap.parse_args()
    sz = dict(QUICK if args.quick else FULL)
    if args.reps:
        sz["reps"] = args.reps
    if args.points:
        sz["points"] = tuple(tuple(int(x) for x in p.split(":")) for p in args.points.split(","))
    target, _, _ = C.fixture_paths()
    models = (args.models or ("fixture" if args.quick else "qwen0.5b")).split(",")
    dtypes = (args.dtypes or ("float32" if args.quick else "bfloat16")).split(",")
    if args.op_check:
        checks = []
        for b, c in sz["points"]:
            r = op_check(b, c + 1)
            checks.append({"batch": b, "context": c + 1, **r})
            print(f"   op check B={b} L={c + 1}: {r}", flush=True)
    results = []
    for m in models:
        path = C.model_path(m, target, args.model_cache)
        for d in dtypes:
            results.append(bench_model(m, path, None if d == "stored" else d, sz))
    txt = print_table(results)
    out = C.out_path("kept_batch", args.quick, args.out)
    C.write_json(out, {"meta": C.meta(args), "sizes": {k: list(v) if isinstance(v, tuple) else v
                                                       for k, v in sz.items()},
                       "results": results, "table": txt,
                       "op_check": checks if args.op_check else None})
    print(f"[bench] wrote {out}")


if __name__ == "__main__":
    main()
