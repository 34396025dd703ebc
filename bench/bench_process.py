"""Whole process: a traced `divergence run` (concurrent) vs a script running mlx-lm's
BatchGenerator on the same prompts, each a fresh Python process, wall clock end to end.

    python bench/bench_process.py                          # qwen0.5b, float32 + bfloat16, 8 x 32 tokens
    python bench/bench_process.py --models fixture --dtypes float32 --reps 5

Each repetition runs both processes (the order flips every repetition); the ratio is
the median of the per-repetition ratios BatchGenerator wall / engine wall (> 1: the
engine's whole run, tracing included, is faster). Both processes load the same BLAS
(divergence.engine.kernels.blas before mlx) and the same model directory in the same dtype; both
include interpreter start, imports, model load, prefill and decode. The engine writes
its trace (KV hashes, kernels, top-k, vocabulary) as `divergence run` always does.
Goal (issue 33): on the 0.5B shape >= 1.0x in fp32 (the same sgemm on both sides) and
>= 1.5x in bf16. Writes bench/results/process.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common as C  # noqa: I001  (first: sys.path + BLAS before mlx)

GOAL = {"float32": 1.0, "bfloat16": 1.5}  # per dtype (issue 33); other dtypes: none

# The BatchGenerator side: what a user of mlx-lm would write for the same job.
BG_SCRIPT = r'''
import json, sys, time
t0 = time.perf_counter()
import divergence.engine.kernels.blas  # the same BLAS as the engine process
import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.utils import load
path, dtype, prompts_file, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
model, tok = load(path)
if dtype != "stored":
    model.set_dtype(getattr(mx, dtype))
prompts = [json.loads(l)["tokens"] for l in open(prompts_file)]
gen = BatchGenerator(model, max_tokens=n, completion_batch_size=max(32, len(prompts)),
                     prefill_batch_size=max(8, len(prompts)))
uids = gen.insert(prompts, [n] * len(prompts))
out = {u: [] for u in uids}
while responses := gen.next_generated():
    for r in responses:
        out[r.uid].append(int(r.token))
gen.close()
print(json.dumps({"tokens": [out[u] for u in uids], "seconds": time.perf_counter() - t0}), flush=True)
import os
os._exit(0)  # (OpenBLAS 0.3.21's exit handler, gotoblas_quit, can deadlock joining its threads here)
'''


def run_engine(path: Path, dtype: str, prompts: Path, n: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "divergence", "run", "--model", str(path), "--prompts", str(prompts),
           "--schedules", "concurrent", "--max-tokens", str(n), "--ignore-eos", "--out", str(out), "--json"]
    if dtype != "stored":
        cmd += ["--dtype", dtype]
    p, wall = _timed(cmd, "divergence run")
    rep = json.loads(p.stdout)
    toks = [r["tokens"]["concurrent"] for r in rep["requests"]]
    size = sum(f.stat().st_size for f in out.glob("*.h5"))
    return {"wall_s": wall, "tokens": toks, "trace_bytes": size}


def run_bg(path: Path, dtype: str, prompts: Path, n: int) -> dict:
    p, wall = _timed([sys.executable, "-c", BG_SCRIPT, str(path), dtype, str(prompts), str(n)], "BatchGenerator script")
    return {"wall_s": wall, "tokens": json.loads(p.stdout.strip().splitlines()[-1])["tokens"]}


HANG_S = 600.0  # a process this much slower than any run here has hung (see _timed)
HUNG: list[str] = []  # the runs that hung and were run again (reported in the JSON)


def _timed(cmd: list[str], what: str, tries: int = 3):
    """(the finished process, its wall seconds). A run that passes HANG_S is killed and run
    again, at most `tries` times. The BatchGenerator script over the system OpenBLAS hung at
    exit in about 1 run in 5 on the 0.5B shape, its output already printed: gdb shows
    OpenBLAS 0.3.21's gotoblas_quit joining a worker thread that waits on its condition
    variable. The script now leaves with os._exit; this stays as the net."""
    for attempt in range(tries):
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=C.ROOT, timeout=HANG_S)
        except subprocess.TimeoutExpired:
            HUNG.append(what)
            print(f"   {what} hung (> {HANG_S:.0f} s): killed, running it again", flush=True)
            continue
        wall = time.perf_counter() - t0
        if p.returncode != 0:
            raise SystemExit(f"{what} failed ({p.returncode}):\n{p.stderr[-3000:]}")
        return p, wall
    raise SystemExit(f"{what} hung {tries} times (> {HANG_S:.0f} s each)")


def _env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(C.ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def bench_one(name: str, path: Path, dtype: str, n_req: int, prompt_len: int, n: int, reps: int,
              tmp: Path) -> dict:
    from divergence.engine.model.loading import load_model

    enc = load_model(path).encode
    prompts = tmp / f"{name}-prompts.jsonl"
    with open(prompts, "w") as f:
        for i, p in enumerate(C.prompts(enc, n_req, prompt_len)):
            f.write(json.dumps({"id": f"r{i}", "tokens": p}) + "\n")
    print(f"\n== {name} {dtype}: {n_req} requests x {n} tokens, prompts of {prompt_len}", flush=True)
    eng, bg = [], []
    # one untimed run of each first: the first process of a bench (the engine's, in rep 1) ran
    # 3-4 s slower than every later one (fp32 0.5B, twice), and the same command run by hand
    # three times in a row did not
    run_engine(path, dtype, prompts, n, tmp / "warmup")
    run_bg(path, dtype, prompts, n)
    for rep in range(reps):
        jobs = [("engine", lambda: run_engine(path, dtype, prompts, n, tmp / f"out{rep}")),
                ("bg", lambda: run_bg(path, dtype, prompts, n))]
        for who, fn in (jobs[::-1] if rep % 2 else jobs):
            (eng if who == "engine" else bg).append(fn())
        print(f"   rep {rep + 1}/{reps}: engine {eng[-1]['wall_s']:.1f} s, BatchGenerator {bg[-1]['wall_s']:.1f} s",
              flush=True)
    ratio = C.paired_ratio([r["wall_s"] for r in bg], [r["wall_s"] for r in eng])
    goal = GOAL.get(dtype) if name.startswith("qwen") else None
    return {"model": name, "dtype": dtype, "path": str(path), "requests": n_req, "tokens": n, "prompt": prompt_len,
            "engine_wall_s": C.summary([r["wall_s"] for r in eng]), "bg_wall_s": C.summary([r["wall_s"] for r in bg]),
            "ratio_bg_over_engine": ratio, "goal": goal, "meets_goal": None if goal is None else ratio >= goal,
            "trace_bytes": eng[0]["trace_bytes"], "trace_bytes_per_token": eng[0]["trace_bytes"] / (n_req * n),
            "tokens_match": sum(a == b for a, b in zip(eng[0]["tokens"], bg[0]["tokens"]))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the fixture in float32, 8 x 16 tokens, 3 reps")
    ap.add_argument("--models", default=None, help="comma list of: fixture, qwen0.5b, qwen0.5b-4bit (default qwen0.5b; --quick: fixture)")
    ap.add_argument("--dtypes", default=None, help="float32, bfloat16, stored (default both; --quick: float32)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=None, help="default 32 (--quick: 16)")
    ap.add_argument("--prompt", type=int, default=16, help="prompt length in tokens")
    ap.add_argument("--reps", type=int, default=None, help="default 5 (--quick: 3)")
    ap.add_argument("--model-cache", default=None)
    ap.add_argument("--out", default=None, help="default bench/results/process.json (--quick: a temp dir)")
    a = ap.parse_args()
    a.models = a.models or ("fixture" if a.quick else "qwen0.5b")
    a.dtypes = a.dtypes or ("float32" if a.quick else "float32,bfloat16")
    a.tokens = a.tokens or (4 if a.quick else 32)
    a.reps = a.reps or (1 if a.quick else 5)
    a.out = C.out_path("process", a.quick, a.out)
    meta = C.meta(a)
    t0 = time.perf_counter()
    target, _, _ = C.fixture_paths(None, None)
    results = []
    with tempfile.TemporaryDirectory(prefix="divergence-process-") as tmp:
        for name in a.models.split(","):
            path = C.model_path(name.strip(), target, a.model_cache)
            for dtype in a.dtypes.split(","):
                results.append(bench_one(name.strip(), path, dtype.strip(), a.requests, a.prompt, a.tokens,
                                         max(1, a.reps), Path(tmp)))
    rows = [[r["model"], r["dtype"], f"{r['requests']} x {r['tokens']}", C.fmt(r["engine_wall_s"]["median"]),
             C.fmt(r["bg_wall_s"]["median"]), C.fmt(r["ratio_bg_over_engine"]),
             f">={r['goal']} " + C.fmt(r["meets_goal"]) if r["goal"] else "", f"{r['trace_bytes_per_token']:.0f}",
             f"{r['tokens_match']}/{r['requests']}"] for r in results]
    txt = C.table(rows, ["model", "dtype", "work", "engine s", "BatchGen s", "ratio", "goal", "trace B/token",
                         "same tokens"])
    print("\n" + txt)
    C.write_json(Path(a.out), {"meta": meta, "goal": GOAL, "results": results, "table": txt.splitlines(),
                               "seconds": time.perf_counter() - t0, "hung_and_rerun": HUNG})


if __name__ == "__main__":
    main()
