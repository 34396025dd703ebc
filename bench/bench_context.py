"""The cost of a generated token as the batch grows and as the context grows, engine vs
mlx-lm, and prefill at long prompts: the table issue 33 asks of the H200.

    python bench/bench_context.py --models qwen0.5b --dtypes bfloat16     # on the GPU
    python bench/bench_context.py --quick                                 # the fixture, small sizes

Per (B, context) point, interleaved and order-flipped each repetition: B requests whose
prompts are `context` tokens long decode `--tokens` tokens; the engine (`concurrent`) vs
mlx-lm (`generate_step` at B=1, `BatchGenerator` above). Reported: ms per generated token
(1 / the aggregate decode rate, from the median step interval), the paired ratio
mlx-lm / engine of those (> 1: the engine is faster), and whether the tokens agree.
Prefill: one prompt of each `--prefill` length, time to the first token vs `generate_step`.
Writes bench/results/context.json (--quick: a temp dir).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import common as C  # noqa: I001  (first: sys.path + BLAS before mlx)
from common import mx

import bench_engine as E
from divergence.engine.engine import Engine

FULL = dict(batches=(1, 8, 32, 64), contexts=(128, 1024, 4096), grid_context=512, tokens=32,
            prefill=(512, 4096), reps=3)
QUICK = dict(batches=(1, 2), contexts=(32,), grid_context=32, tokens=4, prefill=(32,), reps=1)  # a check, not a measurement


def points(sz: dict) -> list[tuple[int, int]]:
    """(B, context): every B at the grid context, and B=1 and B=8 (when asked) at every context."""
    pts = [(b, sz["grid_context"]) for b in sz["batches"]]
    pts += [(b, c) for b in sorted({1, 8} & set(sz["batches"])) or sz["batches"][:1] for c in sz["contexts"]]
    return sorted(set(pts))


def bench_model(name: str, path, dtype, sz: dict) -> dict:
    t = C.load(path, dtype)
    print(f"\n== {name} {t.dtype} ({C.num_params(t) / 1e6:.1f}M params)", flush=True)
    pts = points(sz)
    longest = max([c for _, c in pts] + list(sz["prefill"]))
    bmax = max(b for b, _ in pts)
    prompts = {c: C.prompts(t.encode, bmax, c) for c in {c for _, c in pts} | set(sz["prefill"])}
    clock = C.Clock()
    # a budget that takes the longest prompt in one chunk, as mlx-lm's prefill does
    eng = Engine(t, policy="native", stop_at_eos=False, token_budget=max(4096, longest), observers=[clock],
                 prefill="mlx-lm")
    model = t.model
    # warm-up at every shape family: on MLX CUDA the first run of a shape compiles kernels
    for b, c in pts:
        E.engine_batch(eng, clock, prompts[c][:b], 2)
        (E.mlx_single(model, prompts[c][0], 2) if b == 1 else E.mlx_batch(model, prompts[c][:b], 2))
    for n in sz["prefill"]:
        E.engine_prefill(eng, clock, prompts[n][0])
        E.mlx_prefill(model, prompts[n][0])
    runs = {p: {"engine": [], "mlx_lm": []} for p in pts}
    pre = {n: {"engine": [], "mlx_lm": []} for n in sz["prefill"]}
    N = sz["tokens"]
    for rep in range(sz["reps"]):
        flip = rep % 2 == 1
        for b, c in pts:
            ps = prompts[c][:b]
            jobs = [("engine", lambda ps=ps: E.engine_batch(eng, clock, ps, N)),
                    ("mlx_lm", lambda ps=ps: E.mlx_single(model, ps[0], N) if len(ps) == 1 else E.mlx_batch(model, ps, N))]
            for who, fn in (jobs[::-1] if flip else jobs):
                runs[(b, c)][who].append(fn())
        for n in sz["prefill"]:
            jobs = [("engine", lambda n=n: E.engine_prefill(eng, clock, prompts[n][0])),
                    ("mlx_lm", lambda n=n: E.mlx_prefill(model, prompts[n][0]))]
            for who, fn in (jobs[::-1] if flip else jobs):
                pre[n][who].append(fn())
        print(f"   rep {rep + 1}/{sz['reps']} done", flush=True)
    grid = []
    for (b, c), r in runs.items():
        e, m = [x["decode_tok_s"] for x in r["engine"]], [x["decode_tok_s"] for x in r["mlx_lm"]]
        grid.append({"batch": b, "context": c, "tokens": N,
                     "ms_per_token": {"engine": 1000 / C.med(e), "mlx_lm": 1000 / C.med(m)},
                     "ratio": C.paired_ratio(e, m),
                     "peak_mb": {"engine": C.med([x["peak_mb"] for x in r["engine"]]),
                                 "mlx_lm": C.med([x["peak_mb"] for x in r["mlx_lm"]])},
                     "tokens_match": sum(x == y for x, y in zip(r["engine"][0]["tokens"], r["mlx_lm"][0]["tokens"])),
                     "requests": b})
    prefill = []
    for n, r in pre.items():
        e, m = [x["prefill_tok_s"] for x in r["engine"]], [x["prefill_tok_s"] for x in r["mlx_lm"]]
        prefill.append({"prompt_tokens": n, "tok_s": {"engine": C.med(e), "mlx_lm": C.med(m)},
                        "ratio": C.paired_ratio(e, m)})
    return {"model": name, "dtype": t.dtype, "grid": grid, "prefill": prefill}


def print_tables(results: list[dict]) -> str:
    rows, pre = [], []
    for r in results:
        for g in r["grid"]:
            rows.append([r["model"], r["dtype"], g["batch"], g["context"], C.fmt(g["ms_per_token"]["engine"], 3),
                         C.fmt(g["ms_per_token"]["mlx_lm"], 3), C.fmt(g["ratio"]),
                         f"{g['tokens_match']}/{g['requests']}"])
        for p in r["prefill"]:
            pre.append([r["model"], r["dtype"], p["prompt_tokens"], C.fmt(p["tok_s"]["engine"], 0),
                        C.fmt(p["tok_s"]["mlx_lm"], 0), C.fmt(p["ratio"])])
    txt = C.table(rows, ["model", "dtype", "B", "context", "engine ms/tok", "mlx-lm ms/tok", "ratio", "same tokens"])
    txt += "\n\n" + C.table(pre, ["model", "dtype", "prefill tokens", "engine tok/s", "generate_step tok/s", "ratio"])
    print("\n" + txt)
    return txt


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=None, help="comma list (default qwen0.5b; --quick: fixture)")
    ap.add_argument("--dtypes", default=None, help="comma list: float32, bfloat16, stored (default bfloat16)")
    ap.add_argument("--quick", action="store_true", help="the fixture, small sizes (about a minute on a CPU)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--model-cache", default=None, help="where the random qwen0.5b model is generated/reused")
    ap.add_argument("--out", default=None, help="default bench/results/context.json (--quick: a temp dir)")
    a = ap.parse_args()
    sz = dict(QUICK if a.quick else FULL)
    if a.reps:
        sz["reps"] = max(3, a.reps)
    meta = C.meta(a)
    target, _draft, _where = C.fixture_paths()
    t0 = time.perf_counter()
    results = []
    for name in (a.models or ("fixture" if a.quick else "qwen0.5b")).split(","):
        path = C.model_path(name.strip(), target, a.model_cache)
        for dtype in (a.dtypes or "bfloat16").split(","):
            results.append(bench_model(name.strip(), path, None if dtype.strip() == "stored" else dtype.strip(), sz))
    txt = print_tables(results)
    out = C.out_path("context", a.quick, a.out)
    C.write_json(Path(out), {"meta": meta, "sizes": {k: list(v) if isinstance(v, tuple) else v for k, v in sz.items()},
                             "results": results, "table": txt.splitlines(), "seconds": time.perf_counter() - t0})
    print(f"[bench] total {time.perf_counter() - t0:.0f} s -> {out}")


if __name__ == "__main__":
    main()
