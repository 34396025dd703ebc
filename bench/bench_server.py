"""The workload a server sees: 32 requests, prompt lengths drawn from 8-512, arrivals
staggered over the run; the engine (untraced and traced) vs mlx-lm's BatchGenerator in one
process, paired.

    python bench/bench_server.py                       # fixture + qwen0.5b shape, float32 + bfloat16
    python bench/bench_server.py --quick               # a check: the fixture in float32, 16 requests, prompts 8-128, 8 tokens
    python bench/bench_server.py --models fixture --dtypes float32,bfloat16 --reps 7

Request i arrives at step i * --stagger: the engine's `arrival` (its concurrent schedule
admits it at that engine step), and for BatchGenerator the `next_generated()` call of that
index inserts it. Where nothing is running both jump to the next arrival. Every request
generates --tokens tokens (EOS ignored), greedy. Each repetition runs the three in a
rotating order; ratios are medians of the per-repetition ratios BatchGenerator wall /
engine wall (> 1: the engine is faster); `BG/engine cpu` is the same ratio of the process's CPU
time (every thread), steadier than wall where other processes share the cores. The engine computes the prompt's last token in
its first decode step (prefill="mlx-lm"), as BatchGenerator does. Goal (issue 33): >= 1.3x.
Writes bench/results/server.json (--quick: a temp dir).
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import common as C  # noqa: I001  (first: sys.path + BLAS before mlx)

import numpy as np
from mlx_lm.generate import BatchGenerator

from divergence.core.request import Request
from divergence.engine.engine import Engine
from divergence.trace.writer import TraceWriter

GOAL = 1.3
VARIANTS = ("engine", "engine_traced", "batch_generator")


def workload(encode, n: int, lo: int, hi: int, stagger: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    lens = rng.integers(lo, hi + 1, size=n)
    stream = C.token_stream(encode, int(lens.sum()) + n)
    out, at = [], 0
    for i, length in enumerate(lens):
        out.append({"id": f"r{i}", "tokens": stream[at: at + int(length)], "arrival": i * stagger})
        at += int(length) + 1
    return out


def run_engine(eng: Engine, work, n: int, trace_dir: Path | None) -> dict:
    reqs = [Request(w["id"], tuple(w["tokens"]), max_tokens=n, arrival=w["arrival"]) for w in work]
    C.sync()
    t0, c0 = time.perf_counter(), time.process_time()
    if trace_dir is None:
        eng.observers = []
        res = eng.run(reqs, "concurrent")
    else:
        with TraceWriter(trace_dir / "server.h5", top_k=eng.top_k, kv_hashes=True) as w:
            eng.observers = [w]
            res = eng.run(reqs, "concurrent")
        eng.observers = []
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"wall_s": wall, "cpu_s": cpu, "steps": res.steps, "tokens": [res.outputs[w["id"]].tokens for w in work]}


def run_batch_generator(model, work, n: int) -> dict:
    C.sync()
    t0, c0 = time.perf_counter(), time.process_time()
    gen = BatchGenerator(model, max_tokens=n, completion_batch_size=len(work), prefill_batch_size=8)
    pending = sorted(work, key=lambda w: w["arrival"])
    uid_of, toks, step, steps = {}, {}, 0, 0
    while True:
        due = [w for w in pending if w["arrival"] <= step]
        if due:
            pending = pending[len(due):]
            for w, u in zip(due, gen.insert([list(w["tokens"]) for w in due], [n] * len(due))):
                uid_of[u] = w["id"]
        responses = gen.next_generated()
        if responses:
            steps += 1
            for r in responses:
                toks.setdefault(uid_of[r.uid], []).append(int(r.token))
            step += 1
        elif pending:
            step = pending[0]["arrival"]  # nothing running: the next arrival
        else:
            break
    gen.close()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    del gen
    C.sync()
    return {"wall_s": wall, "cpu_s": cpu, "steps": steps, "tokens": [toks.get(w["id"], []) for w in work]}


def bench_one(name: str, path, dtype: str, a) -> dict:
    loaded = C.load(path, dtype)
    work = workload(loaded.encode, a.requests, a.min_prompt, a.max_prompt, a.stagger)
    eng = Engine(loaded, None, policy="native", stop_at_eos=False, prefill="mlx-lm", token_budget=a.token_budget)
    samples = {v: [] for v in VARIANTS}
    cpu = {v: [] for v in VARIANTS}  # process CPU time (every thread): steadier than wall on a shared machine
    first = {}
    with tempfile.TemporaryDirectory(prefix="divergence-server-") as tmp:
        runs = {"engine": lambda: run_engine(eng, work, a.tokens, None),
                "engine_traced": lambda: run_engine(eng, work, a.tokens, Path(tmp)),
                "batch_generator": lambda: run_batch_generator(loaded.model, work, a.tokens)}
        for v in VARIANTS:  # warm-up: graphs, the vocabulary table, probes
            first[v] = runs[v]()
        for rep in range(a.reps):
            order = VARIANTS[rep % 3:] + VARIANTS[: rep % 3]
            for v in order:
                got = runs[v]()
                samples[v].append(got["wall_s"])
                cpu[v].append(got["cpu_s"])
            print(f"[bench] {name} {dtype} rep {rep + 1}/{a.reps}: " +
                  ", ".join(f"{v} {samples[v][-1]:.2f}s" for v in VARIANTS), flush=True)
    bg = samples["batch_generator"]
    gen_tokens = a.requests * a.tokens
    same = sum(x == y for x, y in zip(first["engine"]["tokens"], first["batch_generator"]["tokens"]))
    lens = [len(w["tokens"]) for w in work]
    return {
        "model": name, "dtype": dtype, "requests": a.requests, "tokens": a.tokens, "stagger_steps": a.stagger,
        "prompt_lens": {"min": min(lens), "max": max(lens), "mean": float(np.mean(lens)), "sum": sum(lens)},
        "token_budget": a.token_budget, "reps": a.reps,
        "wall_s": {v: C.summary(samples[v]) for v in VARIANTS}, "samples_s": samples,
        "tok_s": {v: gen_tokens / C.med(samples[v]) for v in VARIANTS},
        "steps": {v: first[v]["steps"] for v in VARIANTS},
        "bg_over_engine": C.paired_ratio(bg, samples["engine"]),
        "bg_over_engine_traced": C.paired_ratio(bg, samples["engine_traced"]),
        "cpu_s": {v: C.summary(cpu[v]) for v in VARIANTS},
        "bg_over_engine_cpu": C.paired_ratio(cpu["batch_generator"], cpu["engine"]),
        "tracing_overhead": C.paired_ratio(samples["engine_traced"], samples["engine"]) - 1.0,
        "same_tokens": same, "goal": GOAL,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="a check, not the workload: the fixture in float32, 16 requests, prompts 8-128, 8 tokens")
    ap.add_argument("--models", default=None, help="fixture, qwen0.5b (default both; --quick: fixture)")
    ap.add_argument("--dtypes", default=None, help="default float32,bfloat16 (--quick: float32)")
    ap.add_argument("--requests", type=int, default=None, help="default 32 (--quick: 16)")
    ap.add_argument("--min-prompt", type=int, default=8)
    ap.add_argument("--max-prompt", type=int, default=None, help="default 512 (--quick: 128)")
    ap.add_argument("--tokens", type=int, default=None, help="generated tokens per request (default 32; --quick 8)")
    ap.add_argument("--stagger", type=int, default=2, help="steps between arrivals")
    ap.add_argument("--token-budget", type=int, default=512, help="the engine's rows per step")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--model-cache", default=None)
    ap.add_argument("--out", default=None, help="default bench/results/server.json (--quick: a temp dir)")
    a = ap.parse_args()
    a.models = a.models or ("fixture" if a.quick else "fixture,qwen0.5b")
    a.dtypes = a.dtypes or ("float32" if a.quick else "float32,bfloat16")
    a.tokens = a.tokens or (4 if a.quick else 32)
    a.requests = a.requests or (4 if a.quick else 32)
    a.max_prompt = a.max_prompt or (32 if a.quick else 512)
    a.reps = max(5, a.reps)
    out = C.out_path("server", a.quick, a.out)
    meta = C.meta(a)
    t0 = time.perf_counter()
    target, _, _ = C.fixture_paths(None, None)
    results = []
    for name in a.models.split(","):
        path = C.model_path(name.strip(), target, a.model_cache)
        for dtype in a.dtypes.split(","):
            results.append(bench_one(name.strip(), path, dtype.strip(), a))
    rows = [[r["model"], r["dtype"], f"{r['requests']} x {r['tokens']}",
             f"{r['prompt_lens']['min']}-{r['prompt_lens']['max']}",
             C.fmt(r["wall_s"]["engine"]["median"]), C.fmt(r["wall_s"]["engine_traced"]["median"]),
             C.fmt(r["wall_s"]["batch_generator"]["median"]), C.fmt(r["bg_over_engine"]),
             C.fmt(r["bg_over_engine_traced"]), C.fmt(r["bg_over_engine_cpu"]), f"{100 * r['tracing_overhead']:+.1f}%",
             f"{r['steps']['engine']}/{r['steps']['batch_generator']}", f"{r['same_tokens']}/{r['requests']}"]
            for r in results]
    txt = C.table(rows, ["model", "dtype", "work", "prompts", "engine s", "traced s", "BatchGen s",
                         "BG/engine", "BG/traced", "BG/engine cpu", "tracing", "steps eng/BG", "same tokens"])
    print("\n" + txt)
    print(f"(ratios: median of paired BatchGenerator wall / engine wall; goal >= {GOAL}x)")
    C.write_json(out, {"meta": meta, "goal": GOAL, "results": results, "table": txt.splitlines(),
                       "seconds": time.perf_counter() - t0})


if __name__ == "__main__":
    main()
