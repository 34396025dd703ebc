"""The anchors' experiment at their scale: `divergence sweep -n 1000`, one stream.

    python bench/bench_sweep.py                    # -n 1000 under the default policy, native, batch-invariant
    python bench/bench_sweep.py --quick            # -n 40, 4 per-run-loop runs, to a temp dir
    python bench/bench_sweep.py --long 200         # and 200 needles of 128 tokens in fp32 (native, batch-invariant)

Each policy runs as a user would run it: a new process, `divergence sweep -n N --json
[--policy P]` on the embedded fixture (its stored bf16, greedy, 48 tokens, batches of 1..8),
timed from start to exit (model load included). The anchors report 80 unique completions of
1000 on a GPU engine, 1 with batch-invariant kernels. Goal (issue 33): <= 60 s for the
default command on this CPU.

For the ratio, the per-run loop the sweep used before (one engine.run per run, a batch of
1..8 requests around the needle) runs --loop-runs runs in this process, model loaded and
warm, and its seconds per run are scaled to N runs (start-up left out: the ratio flatters
the loop; `cpu speed-up` compares CPU seconds, which other processes on a shared CPU move
less than wall time). The load average is recorded with each measurement.
Writes bench/results/sweep.json (--quick: a temp dir).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import resource
import subprocess
import sys
import time

import common as C  # noqa: I001  (first: sys.path + BLAS before mlx)

from divergence.core.request import Request
from divergence.workloads.sweep import FILLERS

GOAL_S = 60.0
DEFAULT = "default"  # no --policy: what `divergence sweep` picks (threshold:4 on the fixture)


def _child_cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_CHILDREN)
    return u.ru_utime + u.ru_stime


def stream(n: int, policy: str, extra=()) -> dict:
    cmd = [sys.executable, "-m", "divergence", "sweep", "-n", str(n), "--json", *extra]
    if policy != DEFAULT:
        cmd += ["--policy", policy]
    load0 = os.getloadavg()[0]
    cpu0 = _child_cpu()
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=C.ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    cpu = _child_cpu() - cpu0
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {p.returncode}: {p.stderr.strip()[-400:]}")
    r = json.loads(p.stdout)
    sizes = collections.Counter(r["batch_sizes"])
    return {"policy": r["policy"], "asked": policy, "runs": r["runs"], "wall_s": round(wall, 2),
            "cpu_s": round(cpu, 2),
            "unique_completions": r["unique_completions"], "counts": r["counts"],
            "first_difference": r["first_difference"], "stream": r["stream"],
            "batch_sizes_seen": {str(k): sizes[k] for k in sorted(sizes)},
            "load_avg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)], "argv": cmd[2:]}


def per_run_loop(policy: str, runs: int, max_batch: int = 8, max_tokens: int = 48, seed: int = 0) -> dict:
    """The sweep before the stream: one engine.run of a fresh random batch per run."""
    from divergence.workloads.runner import RunConfig, load_models, make_engine
    from divergence.cli.common import default_model_dirs
    from divergence.cli.sweep_cmd import DEFAULT_PROMPT

    target, _ = default_model_dirs()
    cfg = RunConfig(model=target, policy="threshold:4" if policy == DEFAULT else policy)
    load_models(cfg)
    engine = make_engine(cfg)
    needle = tuple(engine.encode(DEFAULT_PROMPT))
    engine.run([Request("needle", needle, max_tokens=max_tokens)], "concurrent")  # warm, and the alone run
    rng = random.Random(seed)
    seen = collections.Counter()
    load0 = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(runs):
        b = rng.randint(1, max_batch)
        reqs = [Request(f"f{j}", tuple(engine.encode(rng.choice(FILLERS))), max_tokens=rng.randint(8, max_tokens),
                        arrival=rng.randint(0, 12)) for j in range(b - 1)]
        reqs.insert(rng.randint(0, len(reqs)), Request("needle", needle, max_tokens=max_tokens,
                                                       arrival=rng.randint(0, 12)))
        seen[tuple(engine.run(reqs, "concurrent").outputs["needle"].tokens)] += 1
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"policy": str(engine.policy), "asked": policy, "runs": runs, "seconds": round(dt, 2),
            "s_per_run": round(dt / runs, 4), "cpu_s_per_run": round(cpu / runs, 4), "unique_completions": len(seen),
            "load_avg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)]}


LONG = ["--prompt", "This module provides", "--max-tokens", "128", "--dtype", "float32"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("-n", type=int, default=1000, help="needles per sweep (--quick: 40)")
    ap.add_argument("--policies", default=f"{DEFAULT},native,batch-invariant")
    ap.add_argument("--loop-runs", type=int, default=24, help="runs of the per-run loop (--quick: 4)")
    ap.add_argument("--long", type=int, default=0,
                    help=f"also sweep this many needles of {' '.join(LONG)} under native and batch-invariant "
                         "(fp32: this CPU's own BLAS kernels; 128 tokens: room to diverge)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.quick:
        a.n, a.loop_runs, a.long = min(a.n, 8), min(a.loop_runs, 1), min(a.long, 2)
    out = C.out_path("sweep", a.quick, a.out)
    meta = C.meta(a)
    results, rows = [], []
    runs = [(p, a.n, [], True) for p in a.policies.split(",")]
    runs += [(p, a.long, LONG, False) for p in ("native", "batch-invariant") if a.long]
    for policy, n, extra, loop_too in runs:
        print(f"[bench] divergence sweep -n {n} {' '.join(extra)} ({policy}) ...", flush=True)
        s = stream(n, policy, extra)
        s.update(goal_s=GOAL_S if policy == DEFAULT else None, options=extra)
        loop_cells = ["-", "-", "-"]
        if loop_too:
            print(f"[bench] the per-run loop, {a.loop_runs} runs ({policy}) ...", flush=True)
            loop = per_run_loop(policy, a.loop_runs)
            est, est_cpu = loop["s_per_run"] * n, loop["cpu_s_per_run"] * n
            s.update(loop=loop, loop_at_n_s=round(est, 1), speedup_vs_loop=round(est / s["wall_s"], 2),
                     cpu_speedup_vs_loop=round(est_cpu / s["cpu_s"], 2))
            loop_cells = [f"{C.fmt(est, 0)} ({loop['runs']} x {C.fmt(loop['s_per_run'], 2)} s)",
                          f"{C.fmt(s['speedup_vs_loop'], 1)}x", f"{C.fmt(s['cpu_speedup_vs_loop'], 1)}x"]
        results.append(s)
        sizes = s["batch_sizes_seen"]
        label = s["policy"] + (" (default)" if policy == DEFAULT else "") + (", fp32, 128 tok" if extra else "")
        rows.append([s["runs"], label, C.fmt(s["wall_s"], 1), C.fmt(s["cpu_s"], 1), s["unique_completions"],
                     s["stream"]["steps"], s["stream"]["fillers"], f"{min(map(int, sizes))}..{max(map(int, sizes))}",
                     *loop_cells, f"{s['load_avg_1m'][0]}-{s['load_avg_1m'][1]}"])
    print(C.table(rows, ["runs", "policy", "wall s", "cpu s", "unique", "steps", "fillers", "batches",
                         "per-run loop at n, s", "speed-up", "cpu speed-up", "load avg"]))
    C.write_json(out, {"meta": meta, "goal": {"default_wall_s": GOAL_S, "runs": a.n}, "results": results})


if __name__ == "__main__":
    main()
