"""Engine core benchmarks, side by side with mlx-lm on the same models, prompts and process.

    python bench/bench_engine.py                       # fixture + qwen0.5b, float32 + bfloat16
    python bench/bench_engine.py --quick               # fewer tokens / batch sizes (a few minutes)
    python bench/bench_engine.py --models fixture --dtypes float32

Per model and dtype it measures, interleaving the engine and mlx-lm in every
repetition (the order flips each repetition) and reporting medians:

* B=1 decode tok/s: the engine (one request) vs mlx-lm `generate_step`.
  Decode rates are B / the median step interval of a run (robust to bursts
  of other processes on a shared machine); tokens / decode time is kept in
  the JSON as `mean_based`.
* aggregate decode tok/s at B=1,2,4,8: the engine (`concurrent`) vs mlx-lm
  `BatchGenerator`, same B prompts of equal length; and the amortized time per
  token (1 / aggregate), which must fall as B grows.
* prefill tok/s (one long prompt, time to the first token) vs `generate_step`.
* peak memory (mx.get_peak_memory, weights included) of the B=max run.

Ratios are engine / mlx-lm, the median of the per-repetition paired ratios.
Goals (issue 13): B=1 >= 0.9x generate_step on the fixture, >= 1.0x on the 0.5B
shape; B=8 >= 1.0x BatchGenerator on the fixture, >= 1.2x on the 0.5B shape.
Writes bench/results/engine.json.
"""
from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import common as C  # noqa: I001  (first: sys.path + BLAS before mlx)
from common import mx

from mlx_lm.generate import BatchGenerator, generate_step

from divergence.engine.engine import Engine
from divergence.core.request import Request

# Issue 13's goals per model: (B=1 vs generate_step, B=8 vs BatchGenerator)
GOALS = {"fixture": (0.9, 1.0), "qwen0.5b": (1.0, 1.2)}
GPU_GOALS = (0.9, 1.0)  # on MLX CUDA (bench/results/cuda/): every model

# Sizes per model (and per dtype where bf16's slow CPU path needs smaller runs): prompt length,
# generated tokens per request, batch sizes, prefill prompt length, repetitions.
SIZES = {
    "fixture": dict(prompt=32, tokens=64, batches=(1, 2, 4, 8), prefill=256, reps=7),
    "qwen0.5b": dict(prompt=16, tokens=10, batches=(1, 2, 4, 8), prefill=64, reps=3),
    ("qwen0.5b", "bfloat16"): dict(prompt=8, tokens=8, batches=(1, 2, 4, 8), prefill=32, reps=3),
    "gpu": dict(prompt=32, tokens=64, batches=(1, 2, 4, 8), prefill=512, reps=5),
}
QUICK = {  # a check that the bench runs (CI's smoke test), not a measurement
    "fixture": dict(prompt=16, tokens=8, batches=(1, 2), prefill=32, reps=1),
    "qwen0.5b": dict(prompt=16, tokens=6, batches=(1, 4, 8), prefill=32, reps=3),
    ("qwen0.5b", "bfloat16"): dict(prompt=4, tokens=5, batches=(1, 8), prefill=16, reps=3),
}


def sizes(table: dict, model: str, dtype: str) -> dict:
    if mx.default_device() == mx.gpu and "gpu" in table:
        return dict(table["gpu"])
    return dict(table.get((model, dtype), table.get(model.replace("-4bit", ""))))


# -- one measurement each ------------------------------------------------------------
def engine_batch(eng: Engine, clock: C.Clock, prompts, n: int) -> dict:
    reqs = [Request(f"r{i}", tuple(p), max_tokens=n) for i, p in enumerate(prompts)]
    C.reset_mem()
    t0 = time.perf_counter()
    res = eng.run(reqs, "concurrent" if len(reqs) > 1 else "serial")
    wall = time.perf_counter() - t0
    sp = clock.split()
    return {
        "wall_s": wall,
        "e2e_tok_s": res.generated_tokens / wall,
        "decode_tok_s": sp["decode_rate_median"],
        "decode_tok_s_mean": sp["decode_tokens"] / sp["decode_s"] if sp["decode_s"] > 0 else None,
        "ttft_s": sp["ttft_s"],
        "steps": res.steps,
        "peak_mb": C.peak_mb(),
        "tokens": [res.outputs[r.id].tokens for r in reqs],
    }


def mlx_single(model, prompt, n: int) -> dict:
    C.reset_mem()
    stamps, toks = [], []
    t0 = time.perf_counter()
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        stamps.append(time.perf_counter())
        toks.append(int(tok))
    wall = time.perf_counter() - t0
    out = {
        "wall_s": wall,
        "e2e_tok_s": n / wall,
        "decode_tok_s": C.median_rate([(t, 1) for t in stamps]),
        "decode_tok_s_mean": (n - 1) / (stamps[-1] - stamps[0]) if n > 1 else None,
        "ttft_s": stamps[0] - t0,
        "peak_mb": C.peak_mb(),
        "tokens": [toks],
    }
    C.sync()  # generate_step leaves one step in flight; keep it out of the next measurement
    return out


def mlx_batch(model, prompts, n: int) -> dict:
    C.reset_mem()
    b = len(prompts)
    gen = BatchGenerator(model, max_tokens=n, completion_batch_size=max(32, b), prefill_batch_size=max(8, b))
    toks: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    uids = gen.insert([list(p) for p in prompts], [n] * b)
    stamps = []  # (time, tokens in this response group)
    while responses := gen.next_generated():
        stamps.append((time.perf_counter(), len(responses)))
        for r in responses:
            toks.setdefault(r.uid, []).append(int(r.token))
    wall = time.perf_counter() - t0
    gen.close()
    dec_tokens = sum(c for _, c in stamps[1:])
    dec_s = stamps[-1][0] - stamps[0][0] if len(stamps) > 1 else 0
    out = {
        "wall_s": wall,
        "e2e_tok_s": sum(len(v) for v in toks.values()) / wall,
        "decode_tok_s": C.median_rate(stamps),
        "decode_tok_s_mean": dec_tokens / dec_s if dec_s > 0 else None,
        "ttft_s": stamps[0][0] - t0,
        "peak_mb": C.peak_mb(),
        "tokens": [toks.get(u, []) for u in uids],
    }
    del gen
    C.sync()
    return out


def engine_prefill(eng: Engine, clock: C.Clock, prompt) -> dict:
    C.reset_mem()
    t0 = time.perf_counter()
    eng.run([Request("p", tuple(prompt), max_tokens=1)], "serial")
    wall = time.perf_counter() - t0
    return {"ttft_s": wall, "prefill_tok_s": len(prompt) / wall, "peak_mb": C.peak_mb()}


def mlx_prefill(model, prompt) -> dict:
    C.reset_mem()
    t0 = time.perf_counter()
    for _tok, _ in generate_step(mx.array(prompt), model, max_tokens=1):
        t1 = time.perf_counter()
        break
    C.sync()
    return {"ttft_s": t1 - t0, "prefill_tok_s": len(prompt) / (t1 - t0), "peak_mb": C.peak_mb()}


# -- one model x dtype ---------------------------------------------------------------------
def bench_one(name: str, path, dtype: str, sz: dict) -> dict:
    t_start = time.perf_counter()
    t = C.load(path, dtype)
    params = C.num_params(t)
    print(f"\n== {name} {dtype}  ({params / 1e6:.1f}M params, {path})", flush=True)
    bmax = max(sz["batches"])
    L, N = sz["prompt"], sz["tokens"]
    ps = C.prompts(t.encode, bmax, L)
    long_prompt = C.prompts(t.encode, 1, sz["prefill"])[0]
    clock = C.Clock()
    # prefill="mlx-lm": the prompt's last token in the first decode step, as generate_step and
    # BatchGenerator compute it (the same work; and on a GPU the same numbers at B=1)
    eng = Engine(t, policy="native", stop_at_eos=False, token_budget=max(256, bmax * L, sz["prefill"]),
                 observers=[clock], prefill="mlx-lm")
    model = t.model

    # warm-up: compiles nothing in MLX, but fills caches, allocator pools, the engine's vocab table
    tw = time.perf_counter()
    eng.run([Request("w", tuple(ps[0][:8]), max_tokens=2)], "serial")
    t_engine_first = time.perf_counter() - tw
    mlx_single(model, ps[0][:8], 2)
    mlx_batch(model, [p[:8] for p in ps[:2]], 2)

    single = {"engine": [], "mlx_lm": []}
    batch = {b: {"engine": [], "mlx_lm": []} for b in sz["batches"]}
    prefill = {"engine": [], "mlx_lm": []}
    for rep in range(sz["reps"]):
        flip = rep % 2 == 1
        # B=1 decode: engine vs generate_step (the engine's run is also its B=1 batch point)
        jobs = [("engine", lambda: engine_batch(eng, clock, ps[:1], N)), ("mlx_lm", lambda: mlx_single(model, ps[0], N))]
        for who, fn in (jobs[::-1] if flip else jobs):
            r = fn()
            single[who].append(r)
            if who == "engine" and 1 in batch:
                batch[1]["engine"].append(r)
        for b in sz["batches"]:
            jobs = [("mlx_lm", lambda b=b: mlx_batch(model, ps[:b], N))]
            if b != 1:
                jobs.insert(0, ("engine", lambda b=b: engine_batch(eng, clock, ps[:b], N)))
            for who, fn in (jobs[::-1] if flip else jobs):
                batch[b][who].append(fn())
        jobs = [("engine", lambda: engine_prefill(eng, clock, long_prompt)), ("mlx_lm", lambda: mlx_prefill(model, long_prompt))]
        for who, fn in (jobs[::-1] if flip else jobs):
            prefill[who].append(fn())
        print(f"   rep {rep + 1}/{sz['reps']}: B=1 decode engine {C.fmt(single['engine'][-1]['decode_tok_s'])}"
              f" mlx-lm {C.fmt(single['mlx_lm'][-1]['decode_tok_s'])} tok/s;"
              f" B={bmax} engine {C.fmt(batch[bmax]['engine'][-1]['decode_tok_s'])}"
              f" BatchGenerator {C.fmt(batch[bmax]['mlx_lm'][-1]['decode_tok_s'])} tok/s", flush=True)

    def metric(runs, key):
        return [r[key] for r in runs]

    def compare(d, key, higher_better=True):
        e, m = metric(d["engine"], key), metric(d["mlx_lm"], key)
        return {"engine": C.summary(e), "mlx_lm": C.summary(m),
                "ratio": C.paired_ratio(e, m) if higher_better else C.paired_ratio(m, e)}

    out = {
        "model": name, "dtype": t.dtype, "path": str(path), "params": params,
        "sizes": {k: list(v) if isinstance(v, tuple) else v for k, v in sz.items()},
        "engine_first_run_s": t_engine_first,
    }
    s = compare(single, "decode_tok_s")
    s["mean_based"] = compare(single, "decode_tok_s_mean")
    s["ttft"] = compare(single, "ttft_s", higher_better=False)
    s["e2e"] = compare(single, "e2e_tok_s")
    s["tokens_match"] = single["engine"][0]["tokens"] == single["mlx_lm"][0]["tokens"]
    goal_b1, goal_b8 = GPU_GOALS if mx.default_device() == mx.gpu else GOALS[name.replace("-4bit", "")]
    s["goal"] = goal_b1
    s["meets_goal"] = s["ratio"] is not None and s["ratio"] >= goal_b1
    out["decode_b1"] = s
    out["batch"] = {}
    for b in sz["batches"]:
        c = compare(batch[b], "decode_tok_s")
        c["mean_based"] = compare(batch[b], "decode_tok_s_mean")
        c["e2e"] = compare(batch[b], "e2e_tok_s")
        c["ttft"] = compare(batch[b], "ttft_s", higher_better=False)
        c["peak_mb"] = compare(batch[b], "peak_mb", higher_better=False)
        eng_ms = C.med(metric(batch[b]["engine"], "decode_tok_s"))
        mlx_ms = C.med(metric(batch[b]["mlx_lm"], "decode_tok_s"))
        c["amortized_ms_per_token"] = {"engine": 1000 / eng_ms if eng_ms else None,
                                       "mlx_lm": 1000 / mlx_ms if mlx_ms else None}
        et, mt = batch[b]["engine"][0]["tokens"], batch[b]["mlx_lm"][0]["tokens"]
        c["tokens_match"] = sum(x == y for x, y in zip(et, mt))
        c["requests"] = b
        out["batch"][str(b)] = c
    for who in ("engine", "mlx_lm"):
        am = [out["batch"][str(b)]["amortized_ms_per_token"][who] for b in sz["batches"]]
        out[f"amortized_falls_{who}"] = all(x is not None and y is not None and y < x for x, y in zip(am, am[1:]))
    if 8 in sz["batches"]:
        r8 = out["batch"]["8"]["ratio"]
        out["b8_goal"] = goal_b8
        out["b8_meets_goal"] = r8 is not None and r8 >= goal_b8
    p = compare(prefill, "prefill_tok_s")
    p["prompt_tokens"] = sz["prefill"]
    out["prefill"] = p
    out["peak_mb_bmax"] = out["batch"][str(bmax)]["peak_mb"]
    out["seconds"] = time.perf_counter() - t_start
    del eng, t, model
    gc.collect()
    mx.clear_cache()
    return out


def print_tables(results: list[dict]) -> str:
    rows = []
    for r in results:
        tag = (r["model"], r["dtype"])
        d = r["decode_b1"]
        rows.append([*tag, "B=1 decode tok/s vs generate_step", C.fmt(d["engine"]["median"]),
                     C.fmt(d["mlx_lm"]["median"]), C.fmt(d["ratio"]), f">={d['goal']} " + C.fmt(d["meets_goal"]),
                     "yes" if d["tokens_match"] else "no"])
        for b, c in r["batch"].items():
            goal = ""
            if b == "8":
                goal = f">={r['b8_goal']} " + C.fmt(r["b8_meets_goal"])
            rows.append([*tag, f"B={b} aggregate decode tok/s vs BatchGenerator", C.fmt(c["engine"]["median"]),
                         C.fmt(c["mlx_lm"]["median"]), C.fmt(c["ratio"]), goal, f"{c['tokens_match']}/{c['requests']}"])
        for b, c in r["batch"].items():
            a = c["amortized_ms_per_token"]
            rows.append([*tag, f"B={b} amortized ms/token", C.fmt(a["engine"]), C.fmt(a["mlx_lm"]),
                         C.fmt(a["mlx_lm"] / a["engine"] if a["engine"] and a["mlx_lm"] else None), "", ""])
        rows.append([*tag, "amortized ms/token falls with B", C.fmt(r["amortized_falls_engine"]),
                     C.fmt(r["amortized_falls_mlx_lm"]), "", "", ""])
        p = r["prefill"]
        rows.append([*tag, f"prefill tok/s ({p['prompt_tokens']}-token prompt)", C.fmt(p["engine"]["median"]),
                     C.fmt(p["mlx_lm"]["median"]), C.fmt(p["ratio"]), "", ""])
        bmax = max(int(b) for b in r["batch"])
        m = r["peak_mb_bmax"]
        rows.append([*tag, f"peak memory MB (B={bmax} run)", C.fmt(m["engine"]["median"]),
                     C.fmt(m["mlx_lm"]["median"]), C.fmt(m["ratio"]), "(ratio: mlx-lm/engine)", ""])
    txt = C.table(rows, ["model", "dtype", "metric", "engine", "mlx-lm", "ratio", "goal", "same tokens"])
    print("\n" + txt)
    return txt


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=None,
                    help="comma list of: fixture, fixture-4bit, qwen0.5b, qwen0.5b-4bit (default fixture,qwen0.5b; --quick: fixture)")
    ap.add_argument("--dtypes", default=None,
                    help="comma list of: float32, bfloat16, float16, stored (as on disk: use it for 4-bit); "
                         "default float32,bfloat16 (--quick: float32)")
    ap.add_argument("--quick", action="store_true", help="the fixture in float32, fewer tokens and batch sizes, 3 repetitions (about a minute)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (>= 3; default 7 fixture, 3 qwen)")
    ap.add_argument("--tokens", type=int, default=None, help="generated tokens per request (override)")
    ap.add_argument("--batches", default=None, help="batch sizes, e.g. 1,2,4,8 (override)")
    ap.add_argument("--target", default=None, help="fixture target directory (default: the embedded fixture)")
    ap.add_argument("--draft", default=None, help="(unused here; for symmetry with bench_speculative)")
    ap.add_argument("--model-cache", default=None, help="where the random qwen0.5b model is generated/reused")
    ap.add_argument("--out", default=None, help="default bench/results/engine.json (--quick: a temp dir)")
    ap.add_argument("--merge", action="store_true",
                    help="keep the other (model, dtype) entries already in --out, replace the measured ones")
    a = ap.parse_args()
    a.models = a.models or ("fixture" if a.quick else "fixture,qwen0.5b")
    a.dtypes = a.dtypes or ("float32" if a.quick else "float32,bfloat16")
    a.out = C.out_path("engine", a.quick, a.out)
    meta = C.meta(a)  # at the start: the engine commit that was measured
    t_all = time.perf_counter()
    target, _draft, where = C.fixture_paths(a.target, a.draft)
    print(f"[bench] fixture target: {target} ({where}); BLAS: {meta['blas']}")
    results = []
    for name in a.models.split(","):
        name = name.strip()
        path = C.model_path(name, target, a.model_cache)
        for dtype in a.dtypes.split(","):
            dtype = None if dtype.strip() in ("", "stored") else dtype.strip()
            sz = sizes(QUICK if a.quick else SIZES, name, dtype or "bfloat16")
            if a.reps:
                sz["reps"] = max(3, a.reps)
            if a.tokens:
                sz["tokens"] = a.tokens
            if a.batches:
                sz["batches"] = tuple(int(x) for x in a.batches.split(","))
            results.append(bench_one(name, path, dtype, sz))
    if a.merge:
        order = {(m, d): i for i, (m, d) in enumerate((m, d) for m in SIZES if isinstance(m, str)
                                                       for d in ("float32", "bfloat16", "float16"))}
        results = sorted(C.merge_results(a.out, results, lambda r: (r["model"], r["dtype"])),
                         key=lambda r: order.get((r["model"], r["dtype"]), 99))
    txt = print_tables(results)
    data = {"meta": meta, "fixture_source": where, "goals": {m: {"b1_vs_generate_step": g[0],
            "b8_vs_batch_generator": g[1]} for m, g in GOALS.items()}, "results": results, "table": txt.splitlines(),
            "seconds": time.perf_counter() - t_all}
    C.write_json(Path(a.out), data)
    print(f"[bench] total {time.perf_counter() - t_all:.0f} s")


if __name__ == "__main__":
    main()
