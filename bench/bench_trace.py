"""Tracing overhead: the engine at B=8 traced vs untraced, paired in one process.

    python bench/bench_trace.py                          # fixture + qwen0.5b shape, float32
    python bench/bench_trace.py --models fixture --reps 7 --dtypes float32,bfloat16

Per model and dtype, every repetition runs the same 8 requests (concurrent, all
arriving at step 0: B=8 decode) in each variant, the order rotating per repetition:

* `untraced`: no observer (the engine skips KV hashing and kernel events; the top-k,
  which every RequestOutput carries, it computes either way);
* `events`: an observer that asks for everything and drops it (the engine's own
  cost of producing trace events, no writer);
* `v2`: this package's TraceWriter (schema 2: flush thread, compound tables);
* `v1`: the schema-1 writer as it was before (loaded from git, `--v1-rev`), for
  the before/after ratios;
* `base`: this package's trace writer at another git revision (`--base-rev`: the
  whole divergence/trace package as it was there), for before/after ratios of a
  change measured in one process, paired (on a busy machine the overheads of two
  separate bench runs are not comparable).

Overhead = median over repetitions of (variant time / untraced time) - 1, time =
Engine.run to the writer closed, as wall time, as CPU time of
the whole process (steadier on a shared machine) and as CPU time of the engine's thread. Bytes per token =
file size / generated tokens. A second table times the writer alone on the engine
thread: a 0.5B-shaped step's events (24 layers, B=8) fed to each writer as the engine
hands them (a step's kernel choices and KV writes one call each, as StepKernels and
StepKvWrites), microseconds per step
spent in its on_* calls (v2 encodes every 8 steps there, so its mean is above its
median; its writes are the flush thread's, excluded; v1 encodes and flushes on the
caller's thread), and the file's bytes as a fixed part plus bytes per token. Writes bench/results/trace.json.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import common as C  # noqa: I001  (first: sys.path + BLAS before mlx)

import numpy as np

from divergence.core.events import (
    Observer, RunInfo, SeqSlice, StepEvent, StepKernels, StepKvWrites, StepPlan, TokenEvent,
)
from divergence.core.request import Request
from divergence.engine.engine import Engine
from divergence.trace.writer import TraceWriter

GOAL = 0.05  # issue 33: tracing <= 5 % wall at B=8
B = 8
METRICS = ("wall", "cpu", "thread")


class Drop(Observer):
    """Asks for every event and drops it: the engine's cost of producing them."""

    wants_kv_hashes = wants_topk = wants_kernels = wants_routing = wants_records = True


def load_v1_writer(rev: str):
    """The schema-1 TraceWriter at git revision `rev`, as a module (its schema alongside)."""
    pkg = types.ModuleType("_trace_v1")
    pkg.__path__ = []
    sys.modules["_trace_v1"] = pkg
    mods = {}
    for name in ("schema", "writer"):
        src = subprocess.run(["git", "show", f"{rev}:divergence/trace/{name}.py"], cwd=C.ROOT, capture_output=True,
                             text=True, check=True).stdout
        src = src.replace("from ..core", "from divergence.core")
        spec = importlib.util.spec_from_loader(f"_trace_v1.{name}", loader=None)
        mod = importlib.util.module_from_spec(spec)
        mod.__package__ = "_trace_v1"
        sys.modules[spec.name] = mod
        exec(compile(src, f"{rev}:divergence/trace/{name}.py", "exec"), mod.__dict__)
        mods[name] = mod
    assert mods["schema"].SCHEMA_VERSION == 1, f"{rev} is not a schema-1 writer"
    return mods["writer"].TraceWriter


class _GitPackage(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `name`.X as divergence/trace/X.py at git revision `rev` (the package's own
    relative imports resolve inside it; `..` imports go to the current divergence)."""

    def __init__(self, name: str, rev: str):
        self.name, self.rev = name, rev

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name or fullname.startswith(self.name + "."):
            return importlib.util.spec_from_loader(fullname, self, is_package=fullname == self.name)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        if module.__name__ == self.name:
            module.__path__ = []
            return
        rel = module.__name__[len(self.name) + 1:].replace(".", "/")
        src = subprocess.run(["git", "show", f"{self.rev}:divergence/trace/{rel}.py"], cwd=C.ROOT,
                             capture_output=True, text=True, check=True).stdout
        src = src.replace("from ..", "from divergence.")
        exec(compile(src, f"{self.rev}:divergence/trace/{rel}.py", "exec"), module.__dict__)


def load_base_writer(rev: str):
    """The TraceWriter of divergence/trace at git revision `rev`, with its own copy of the package."""
    name = f"_trace_base_{rev}"
    sys.meta_path.insert(0, _GitPackage(name, rev))
    return importlib.import_module(f"{name}.writer").TraceWriter


def requests(encode, n_tokens: int, prompt_len: int) -> list[Request]:
    return [Request(f"r{i}", tuple(p), max_tokens=n_tokens) for i, p in enumerate(C.prompts(encode, B, prompt_len))]


def one_run(engine: Engine, reqs, variant: str, out: Path, writers: dict) -> tuple[dict, int, int]:
    """({wall, cpu, thread} seconds, trace bytes, generated tokens). cpu: the whole process
    (every thread: MLX's, the flush thread); thread: the engine's (calling) thread only."""
    path = out / f"{variant}.h5"
    if variant == "untraced":
        obs = []
    elif variant == "events":
        obs = [Drop()]
    else:
        obs = [writers[variant](path, top_k=engine.top_k, kv_hashes=True)]
    engine.observers = obs
    C.sync()
    t0, c0, th0 = time.perf_counter(), time.process_time(), time.thread_time()
    if variant in writers:
        with obs[0]:  # closed (flushed) inside the timing
            res = engine.run(reqs, "concurrent")
    else:
        res = engine.run(reqs, "concurrent")
    wall = {"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0, "thread": time.thread_time() - th0}
    engine.observers = []
    size = path.stat().st_size if path.exists() else 0
    tokens = sum(len(o.tokens) for o in res.outputs.values())
    if path.exists():
        path.unlink()
    return wall, size, tokens


def measure(name: str, path, dtype: str, args, writers: dict) -> dict:
    loaded = C.load(path, dtype)
    engine = Engine(loaded, None, policy="native", stop_at_eos=False, top_k=8)
    reqs = requests(loaded.encode, args.tokens, args.prompt)
    variants = ["untraced", "events", "v2"] + [v for v in ("base", "v1") if v in writers]
    walls = {m: {v: [] for v in variants} for m in METRICS}
    sizes, tokens = {}, 0
    with tempfile.TemporaryDirectory() as tmp:
        one_run(engine, reqs, "v2", Path(tmp), writers)  # warm-up (graphs, vocab, caches)
        for rep in range(args.reps):
            order = variants[rep % len(variants):] + variants[: rep % len(variants)]
            for v in order:
                wall, size, tokens = one_run(engine, reqs, v, Path(tmp), writers)
                for m in METRICS:
                    walls[m][v].append(wall[m])
                if size:
                    sizes[v] = size
            print(f"[bench] {name} {dtype} rep {rep + 1}/{args.reps}: " +
                  ", ".join(f"{v} {walls['wall'][v][-1]:.2f}s" for v in variants), flush=True)
    out = {
        "model": name, "dtype": dtype, "batch": B, "tokens_per_request": args.tokens, "prompt_len": args.prompt,
        "generated_tokens": tokens, "reps": args.reps,
        "bytes_per_token": {v: sizes[v] / tokens for v in sizes}, "goal_overhead": GOAL,
    }
    for m in METRICS:
        ratio = {v: C.paired_ratio(walls[m][v], walls[m]["untraced"]) for v in variants}
        out[f"{m}_s"] = {v: C.summary(walls[m][v]) for v in variants}
        out[f"overhead_{m}"] = {v: ratio[v] - 1.0 if ratio[v] is not None else None for v in variants
                                if v != "untraced"}
        out[f"v2_vs_v1_{m}"] = C.paired_ratio(walls[m]["v2"], walls[m]["v1"]) if "v1" in variants else None
        if "base" in variants:
            out[f"v2_vs_base_{m}"] = C.paired_ratio(walls[m]["v2"], walls[m]["base"])
    if "base" in variants:
        out["base_rev"] = args.base_rev
    out["overhead"] = out["overhead_wall"]
    return out


# -- the writer alone, on the engine thread ------------------------------------------------------
def synthetic_steps(n_steps: int, layers: int = 24, k: int = 8):
    """Events of a 0.5B-shaped decode step at B=8 (per step: 7 linear ops x 24 layers + lm_head,
    as the engine's one StepKernels of rows shared by the steps; a KV write per request and
    layer, as its one StepKvWrites; 8 tokens)."""
    rng = np.random.default_rng(0)
    ops = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    reqs = [Request(f"r{i}", (1, 2, 3), max_tokens=n_steps + 1) for i in range(B)]
    rows = {(L, op): ("target", L, op, B, "native", B, 896, 896, 1, 0, -1, 0) for L in range(layers) for op in ops}
    rows["head"] = ("target", layers, "lm_head", B, "native", B, 151936, 896, 1, 0, -1, 0)
    steps = []
    for s in range(n_steps):
        kern = StepKernels(s, [rows[L, op] for L in range(layers) for op in ops] + [rows["head"]])
        h = rng.integers(0, 2**63, (2, B * layers), dtype=np.uint64)  # K and V differ, as real hashes do
        ids = rng.integers(0, 151936, (B, k)).astype(np.int32)
        vals = rng.normal(10, 1, (B, k)).astype(np.float32)
        tok = [TokenEvent(s, f"r{i}", 4 + s, int(ids[i, 0]), 0, ids[i], vals[i]) for i in range(B)]
        plan = StepPlan(s, "target", tuple(SeqSlice(f"r{i}", "decode", 3 + s, 1, i, (int(ids[i, 0]),), (0,))
                                           for i in range(B)))
        kv = StepKvWrites(s, "target", plan.slices, layers, h[0], h[1])  # as the engine's kv_writes gives them
        steps.append((kern, kv, tok, StepEvent(plan, 0.01)))
    return reqs, steps


def writer_thread_cost(writers: dict, n_steps: int, step_s: float) -> list[dict]:
    """µs per step the engine thread spends in each writer's on_* calls, steps paced at
    step_s; file bytes as fixed + per token (sizes after n_steps // 10 and n_steps)."""
    reqs, steps = synthetic_steps(n_steps)
    out = []
    for v, cls in writers.items():
        sizes = {}
        for n in (max(1, n_steps // 10), n_steps):
            with tempfile.TemporaryDirectory() as tmp:
                w = cls(Path(tmp) / "t.h5", top_k=8)
                w.on_run_start(RunInfo("concurrent", "native", {"top_k": 8}, reqs, {"path": "x"}, None, {}, ()))
                spent = []
                c0 = time.process_time()
                for kern, kv, tok, st in steps[:n]:
                    t0 = time.perf_counter()
                    w.on_kernels(kern)  # a step's lists in one call each, as the engine hands them
                    w.on_kv_writes(kv)
                    for t in tok:
                        w.on_token(t)
                    w.on_step(st)
                    spent.append(time.perf_counter() - t0)
                    time.sleep(max(0.0, step_s - spent[-1]))  # an engine step's compute, GIL released
                t0 = time.perf_counter()
                w.on_run_end(True)
                close = time.perf_counter() - t0
                cpu = (time.process_time() - c0) / n  # every thread: the writer's whole work per step
                sizes[n] = (Path(tmp) / "t.h5").stat().st_size
        (n1, s1), (n2, s2) = sorted(sizes.items())
        per_token = (s2 - s1) / ((n2 - n1) * B)
        out.append({"writer": v, "steps": n_steps, "step_s": step_s, "us_per_step_median": C.med(spent) * 1e6,
                    "us_per_step_mean": float(np.mean(spent)) * 1e6, "close_s": close,
                    "cpu_us_per_step_all_threads": cpu * 1e6, "bytes_per_token": s2 / (n2 * B), "bytes_per_token_marginal": per_token,
                    "bytes_fixed": s1 - per_token * n1 * B})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the fixture, 1 rep of 4 tokens, no v1, a short writer-only run: a check")
    ap.add_argument("--models", default=None, help="comma list of: fixture, qwen0.5b (default both; --quick: fixture)")
    ap.add_argument("--dtypes", default="float32", help="comma list of: float32, bfloat16, float16")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32, help="generated tokens per request")
    ap.add_argument("--prompt", type=int, default=32, help="prompt length")
    ap.add_argument("--v1-rev", default=None, help="git revision of the schema-1 writer (default 6d4603a; '' or --quick: skip)")
    ap.add_argument("--base-rev", default="", help="git revision of divergence/trace to compare against (variant base)")
    ap.add_argument("--writer-steps", type=int, default=200, help="steps of the writer-only timing (0: skip)")
    ap.add_argument("--target", default=None, help="fixture target directory")
    ap.add_argument("--model-cache", default=None, help="where the random qwen0.5b model is generated/reused")
    ap.add_argument("--out", default=None, help="default bench/results/trace.json (--quick: a temp dir)")
    args = ap.parse_args()
    args.models = args.models or ("fixture" if args.quick else "fixture,qwen0.5b")
    args.v1_rev = ("" if args.quick else "6d4603a") if args.v1_rev is None else args.v1_rev
    if args.quick:  # a check that it runs, not a measurement
        args.writer_steps = min(args.writer_steps, 20)
        args.reps, args.tokens = min(args.reps, 1), min(args.tokens, 4)
    args.out = C.out_path("trace", args.quick, args.out)

    writers = {"v2": TraceWriter}
    if args.base_rev:
        writers["base"] = load_base_writer(args.base_rev)
    if args.v1_rev:
        writers["v1"] = load_v1_writer(args.v1_rev)
    load_before = os.getloadavg()  # (other work on the machine: the ratios' noise)
    target, _, where = C.fixture_paths(args.target)
    paths = {"fixture": target, "qwen0.5b": None}
    results = []
    for name in args.models.split(","):
        path = paths[name] or C.qwen_path(target, args.model_cache)
        for dtype in args.dtypes.split(","):
            results.append(measure(name, path, dtype, args, writers))
    alone = []
    if args.writer_steps:
        for step_s in (0.0, 0.01):
            alone += writer_thread_cost(writers, args.writer_steps, step_s)

    rows = []
    for r in results:
        for m in METRICS:
            o = r[f"overhead_{m}"]
            v1 = o.get("v1")
            rows.append([r["model"], r["dtype"], f"B={B}x{r['tokens_per_request']}", m,
                         C.fmt(r[f"{m}_s"]["untraced"]["median"]), C.fmt(100 * o["events"], 1) + "%",
                         C.fmt(100 * o["v2"], 1) + "%", C.fmt(100 * v1, 1) + "%" if v1 is not None else "-",
                         C.fmt(r[f"v2_vs_v1_{m}"], 3), C.fmt(r.get(f"v2_vs_base_{m}"), 3),
                         C.fmt(100 * o["base"], 1) + "%" if o.get("base") is not None else "-",
                         C.fmt(r["bytes_per_token"].get("v2"), 0), C.fmt(r["bytes_per_token"].get("v1"), 0)])
    print()
    print(C.table(rows, ["model", "dtype", "run", "time", "untraced s", "events only", "v2 overhead", "v1 overhead",
                         "v2/v1", "v2/base", "base overhead", "v2 B/token", "v1 B/token"]))
    print(f"(goal: v2 overhead <= {GOAL:.0%}; wall = elapsed, cpu = all threads of the process, thread = the "
          "engine's thread)")
    if alone:
        print()
        print(C.table([[a["writer"], f"{a['step_s'] * 1e3:.0f} ms", a["steps"], C.fmt(a["us_per_step_median"], 0),
                        C.fmt(a["us_per_step_mean"], 0), C.fmt(a["cpu_us_per_step_all_threads"], 0),
                        C.fmt(a["close_s"], 3), C.fmt(a["bytes_per_token"], 0),
                        C.fmt(a["bytes_per_token_marginal"], 0), C.fmt(a["bytes_fixed"] / 1e3, 0)]
                       for a in alone],
                      ["writer", "step pace", "steps", "engine-thread us/step (median)", "mean",
                       "CPU us/step (all threads)", "close s",
                       "B/token", "B/token marginal", "fixed KB"]))
        print("(writer alone: a 0.5B-shaped decode step's events at B=8, 24 layers; v1 flushes on the engine "
              "thread, v2 encodes there every 8 steps and writes on its flush thread)")
    print(f"(load average, 1 min: {load_before[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end, on "
          f"{os.cpu_count()} CPUs)")
    loadavg = {"start": [round(x, 2) for x in load_before], "end": [round(x, 2) for x in os.getloadavg()]}
    C.write_json(Path(args.out), {"meta": C.meta(args), "loadavg_1_5_15min": loadavg, "fixture": where, "results": results,
                                  "writer_engine_thread": alone})


if __name__ == "__main__":
    main()
