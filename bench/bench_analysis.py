"""Analysis and tracing benchmarks (issues: traces, bisect).

1. diff + bisect on a synthetic pair of traces with >= 1,000,000 KV-write records
   and 100,000 tokens (goal: <= 2 s, vectorised numpy, no per-record loops).
2. Tracing overhead: aggregate tok/s with full tracing vs tracing off, B=1 and B=8,
   on the fixture (goal: <= 10 % at B=8), and trace bytes per generated token.
3. Replay time relative to the original run.

    python bench/bench_analysis.py [--quick]

Prints a table and writes bench/results/analysis.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from divergence.core.events import KvWrite, RunInfo, SeqSlice, StepEvent, StepPlan, TokenEvent
from divergence.core.request import Request
from divergence.trace.writer import TraceWriter

RESULTS = Path(__file__).parent / "results"


def synthetic_trace(path, *, tokens_per_request=50_000, layers=10, flip_at=40_000, contaminate_at=None, top_k=8):
    """Two requests decoding one token a step; every step writes one position per layer."""
    reqs = [Request("r1", (1, 2, 3), max_tokens=tokens_per_request), Request("r2", (4, 5, 6), max_tokens=tokens_per_request)]
    w = TraceWriter(path, top_k=top_k)
    w.on_run_start(RunInfo("serial", "native", {"top_k": top_k}, reqs, {"weights_hash": "x", "dtype": "float32"},
                           None, {}, ()))
    rng = np.random.default_rng(0)
    ids = np.arange(top_k, dtype=np.int32)
    step = 0
    for i in range(tokens_per_request):
        for r in reqs:
            pos = 3 + i
            plan = StepPlan(step, "target", (SeqSlice(r.id, "decode", pos - 1, 1, 0, (7,), (0,)),))
            for layer in range(layers):
                h = np.array([hash((r.id, layer, pos)) & 0x7FFFFFFFFFFFFFFF], np.uint64)
                if contaminate_at is not None and r.id == "r1" and pos - 1 == contaminate_at and layer == 0:
                    h = h + np.uint64(1)
                w.on_kv_write(KvWrite(step, "target", r.id, layer, pos - 1, 1, h, h))
            logits = np.linspace(10, 9, top_k, dtype=np.float32)
            tok = 0
            if contaminate_at is not None and r.id == "r1" and pos - 1 > contaminate_at:
                logits = logits + np.float32(1e-3)
                if pos >= 3 + flip_at:
                    tok = 1
            w.on_token(TokenEvent(step, r.id, pos, tok, 0, ids, logits))
            w.on_step(StepEvent(plan, 0.0))
            step += 1
    w.on_run_end(True)
    del rng


def bench_bisect(quick: bool) -> dict:
    from divergence import Trace
    from divergence.analysis.bisect import bisect_traces
    from divergence.analysis.diff import diff_traces

    n = 500 if quick else 50_000
    tmp = Path(tempfile.mkdtemp())
    t0 = time.perf_counter()
    synthetic_trace(tmp / "a.h5", tokens_per_request=n)
    synthetic_trace(tmp / "b.h5", tokens_per_request=n, contaminate_at=n // 10, flip_at=int(n * 0.8))
    build = time.perf_counter() - t0
    times_diff, times_bisect = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        with Trace.open(tmp / "a.h5") as a, Trace.open(tmp / "b.h5") as b:
            d = diff_traces(a, b)
        times_diff.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with Trace.open(tmp / "a.h5") as a, Trace.open(tmp / "b.h5") as b:
            rep = bisect_traces(a, b)
            kv_records = len(a.kv_hashes()["k_hash"])
        times_bisect.append(time.perf_counter() - t0)
    c = rep.causes["r1"]
    assert c.kind == "cache_contamination" and c.positions == [n // 10], (c.kind, c.positions)
    return {"tokens": 2 * n, "kv_records": kv_records, "build_s": build,
            "diff_s": statistics.median(times_diff), "bisect_s": statistics.median(times_bisect),
            "diverged": [r.id for r in d.diverged], "goal_s": 2.0}


def bench_tracing(quick: bool) -> dict:
    from divergence.engine.engine import Engine
    from divergence.engine.model.loading import load_model
    from divergence.fixtures import TARGET
    from divergence import Trace

    t = load_model(TARGET)
    prompts = ["Return the number of", "This module provides", "Create a new", "Open file and return",
               "The socket module", "Convert a number", "Decode the object", "If the object"]
    n_tok = 4 if quick else 64
    out = {}
    tmp = Path(tempfile.mkdtemp())
    for b in (1, 8):
        reqs = [Request(f"r{i}", tuple(t.encode(prompts[i])), max_tokens=n_tok) for i in range(b)]
        plain_t, traced_t = [], []
        size = 0
        for rep in range(3):  # interleaved: the machine is noisy
            e = Engine(t, policy="native", stop_at_eos=False)
            plain_t.append(e.run(reqs, "concurrent").seconds)
            path = tmp / f"b{b}_{rep}.h5"
            with TraceWriter(path) as w:
                e = Engine(t, policy="native", stop_at_eos=False, observers=[w])
                res = e.run(reqs, "concurrent")
            traced_t.append(res.seconds)
            size = path.stat().st_size
        tokens = b * n_tok
        p, q = statistics.median(plain_t), statistics.median(traced_t)
        out[f"B={b}"] = {"tok_s_plain": tokens / p, "tok_s_traced": tokens / q, "overhead": q / p - 1,
                         "trace_bytes_per_token": size / tokens}
        # replay time relative to the original run
        from divergence.analysis.replayer import Replayer
        with Trace.open(path) as tr:
            t0 = time.perf_counter()
            Replayer().run(tr)
            out[f"B={b}"]["replay_vs_run"] = (time.perf_counter() - t0) / q
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    res = {"bisect": bench_bisect(args.quick), "tracing": bench_tracing(args.quick), "quick": args.quick}
    b = res["bisect"]
    print(f"diff + bisect on {b['tokens']:,} tokens, {b['kv_records']:,} KV records: "
          f"diff {b['diff_s']:.2f} s, bisect {b['bisect_s']:.2f} s (goal <= {b['goal_s']} s each)")
    print(f"{'batch':<6} {'tok/s off':>10} {'tok/s traced':>13} {'overhead':>9} {'bytes/token':>12} {'replay/run':>11}")
    for k, v in res["tracing"].items():
        print(f"{k:<6} {v['tok_s_plain']:>10.1f} {v['tok_s_traced']:>13.1f} {v['overhead']:>8.1%} "
              f"{v['trace_bytes_per_token']:>12.0f} {v['replay_vs_run']:>10.2f}x")
    out = Path(tempfile.gettempdir()) / "divergence-bench" / "quick" if args.quick else RESULTS
    out.mkdir(parents=True, exist_ok=True)  # --quick: a temp dir, the recorded result stays
    (out / "analysis.json").write_text(json.dumps(res, indent=2))
    print(f"[bench] wrote {out / 'analysis.json'}")


if __name__ == "__main__":
    main()
