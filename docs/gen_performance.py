#!/usr/bin/env python3
"""Write docs/performance.md from bench/results/: one section per bench, what it claims, the
figures of its latest JSON, and on which machine they were measured.

    python docs/gen_performance.py            # rewrite docs/performance.md
    python docs/gen_performance.py --check    # exit 1 if the page is not what the results give

bench/results/NAME.json holds the latest result of bench NAME on the project's 2-core CPU
machine, bench/results/cuda/NAME.json on one NVIDIA H200 (the two machine kinds measured).
Each JSON's `meta` says when, at which commit, with which MLX and BLAS, and the exact argv.
tests/docs/test_shown_output.py runs `--check`, so the page cannot drift from the results.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "performance.md"

MACHINES = {
    "": "the project's 2-core x86-64 CPU machine (its developers' and CI's kind; AVX-512, OpenBLAS "
        "0.3.21 where installed)",
    "cuda": "one NVIDIA H200 (MLX's CUDA backend), 16 host CPU cores",
}

# bench name -> (script, what it claims); the order of the page
BENCHES = {
    "engine": ("bench_engine.py", "Decode speed next to mlx-lm on the same model, prompts and process: B=1 against "
               "`generate_step`, B>1 aggregate against `BatchGenerator`, prefill, peak memory. Ratios are engine / "
               "mlx-lm, medians of paired, interleaved repetitions: above 1 the engine is faster."),
    "context": ("bench_context.py", "The cost of a generated token as the batch and the context grow, engine vs "
                "mlx-lm, and prefill at long prompts."),
    "profile": ("profile_engine.py", "Where a decode step's time goes (graph build, queue, wait, commit, the loop), "
                "engine vs mlx-lm."),
    "speculative": ("bench_speculative.py", "Speculative decoding at k = 1..6 against mlx-lm's "
                    "`speculative_generate_step`, and the prefix cache's hit rate and prefill savings."),
    "trace": ("bench_trace.py", "What tracing costs: the engine at B=8 traced vs untraced, paired in one process "
              "(wall, process CPU and engine-thread CPU), and bytes of trace per token."),
    "serve": ("bench_serve.py", "`divergence serve` (tracing on) against `mlx_lm.server` under the same streamed "
              "client load, without and with a draft model: divergence / mlx-lm ratios (above 1 is better for "
              "tokens/s, below 1 for latencies)."),
    "server": ("bench_server.py", "A server's workload in one process: 32 requests of 8-512 prompt tokens arriving "
               "over the run, the engine (untraced and traced) against `BatchGenerator`."),
    "process": ("bench_process.py", "A whole traced `divergence run` process against a `BatchGenerator` script, "
                "interpreter start to exit."),
    "startup": ("bench_startup.py", "From a loaded model to the first traced step, against `BatchGenerator`'s first "
                "tokens: the engine's start-up overhead, with its backend probes read from the cache or made anew."),
    "sweep": ("bench_sweep.py", "`divergence sweep -n 1000` (one prompt 1,000 times in one continuous-batching "
              "stream): unique completions and time per policy."),
    "analysis": ("bench_analysis.py", "diff + bisect on a synthetic pair of 1,000,000 KV-write records, replay "
                 "against the original run."),
    "moe": ("bench_moe.py", "Mixture-of-experts decode next to mlx-lm, and the experts op's byte and bandwidth "
            "factors."),
    "tp": ("bench_tp.py", "TP=2 against TP=1 on one machine, and the all-reduce's share of a TP=2 run."),
    "sampler_cost": ("sampler_cost.py", "The engine's sampler (greedy ids, top-k, the chosen logit, an fp32 "
                     "logsumexp) against mlx-lm's, per call at B rows of a 151,936-word vocabulary."),
    "compile": ("compile_decode.py", "What `mx.compile` of a decode layer's parts buys mlx-lm's own decode loop, and "
                "whether it keeps the logits bit for bit."),
    "first_run": ("first_run.py", "A fresh machine's first run, dominated by MLX CUDA compiling kernel modules on "
                  "first use."),
    "confirm": ("bench_confirm.py", "What `bisect --confirm` of every diverged request costs against the `run` of "
                "both schedules, with the sparse replay (only the steps a request needs) and the full one (every step from the "
                "first to the one the check reads), and "
                "confirming one request from the first, middle and last tenth of a large trace against that "
                "request's own serial re-run (fixture models, the demo's settings, 32 tokens a request)."),
    "confirm_live": ("bench_confirm.py --live N", "Real HTTP traffic: N concurrent requests through `divergence "
                     "serve`, its trace re-run serially, then every divergence named and confirmed."),
    "reading": ("bench_reading.py", "Peak memory (RSS) and time of `diff` and `bisect` of synthetic live-server "
                "trace pairs up to 10 GB, every request and `--requests` two, against whole-table reads: large "
                "traces are read as row ranges (trace/ranged.py), so memory stays bounded."),
}


def machine_line(meta: dict | None, kind: str) -> str:
    meta = meta or {}
    bits = [f"measured on {MACHINES[kind]}"]
    if meta.get("date"):
        bits.append(str(meta["date"])[:10])
    if meta.get("git_commit"):
        bits.append(f"commit {str(meta['git_commit'])[:7]}" + (" (+ uncommitted changes)" if meta.get(
            "engine_tree_dirty") else ""))
    if meta.get("mlx"):
        bits.append(f"MLX {meta['mlx']}")
    if meta.get("blas") and kind == "":
        bits.append(str(meta["blas"]).split(" (")[0])
    if meta.get("argv") is not None:
        bits.append("args `" + (" ".join(map(str, meta["argv"])) or "(defaults)") + "`")
    return "; ".join(bits) + "."


def _pct(x) -> str:
    return "" if x is None else f"{100 * x:+.1f} %"


def _ratio(x) -> str:
    return "" if x is None else f"{x:.2f}x"


def _rows(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out


def table(name: str, data: dict) -> list[str]:
    """A result's figures as Markdown: the bench's own printed table where it keeps one."""
    if isinstance(data.get("table"), list):
        return ["```", *data["table"], "```"]
    if isinstance(data.get("table"), str):
        return ["```", data["table"].rstrip("\n"), "```"]
    res = data.get("results")
    if name == "serve":
        return _rows(["mode", "tokens/s", "(per rep)", "latency p50", "latency p99", "TTFT p50"],
                     [[r["mode"], _ratio(r["ratios"]["tokens_per_s"]),
                       ", ".join(f"{x:.2f}" for x in r["ratio_per_rep"]["tokens_per_s"]),
                       _ratio(r["ratios"]["latency_p50_s"]), _ratio(r["ratios"]["latency_p99_s"]),
                       _ratio(r["ratios"]["ttft_p50_s"])] for r in res])
    if name == "sweep":
        return _rows(["policy", "runs", "unique completions", "wall s", "CPU s"],
                     [[r["policy"], r["runs"], r["unique_completions"], r.get("wall_s", ""), r.get("cpu_s", "")]
                      for r in res])
    if name == "trace":
        return _rows(["model", "dtype", "reps", "wall", "process CPU", "engine thread CPU", "bytes/token"],
                     [[r["model"], r["dtype"], r["reps"], _pct(r["overhead_wall"].get("v2")),
                       _pct(r["overhead_cpu"].get("v2")), _pct(r["overhead_thread"].get("v2")),
                       round(r["bytes_per_token"].get("v2", 0))] for r in res])
    if name == "tp":
        return _rows(["model", "dtype", "TP=2 / TP=1 tok/s", "all-reduce share (in place)", "(timed alone)"],
                     [[r["model"], r["dtype"], _ratio(r["tp2_over_tp1"]), _pct(r.get("allreduce_share_in_place")),
                       _pct(r.get("allreduce_share_isolated"))] for r in res])
    if name == "analysis":
        b, t = data["bisect"], data["tracing"]
        rows = [[f"diff of {b['kv_records']:,} KV records", f"{b['diff_s']:.2f} s"],
                [f"bisect of {b['kv_records']:,} KV records (goal {b['goal_s']} s)", f"{b['bisect_s']:.2f} s"]]
        rows += [[f"tracing overhead at {k}", _pct(v["overhead"])] for k, v in t.items() if "overhead" in v]
        rows += [[f"replay / run at {k}", _ratio(v["replay_vs_run"])] for k, v in t.items() if "replay_vs_run" in v]
        return _rows(["what", "figure"], rows)
    if name == "first_run":
        return _rows(["side", "tree", "first run s", "second run s", "modules compiled"],
                     [[r["side"], r["tree"], f"{r['first_s']:.1f}", f"{r['second_s']:.2f}", r["modules_compiled"]]
                      for r in res])
    if name == "confirm":
        out = _rows(["requests", "run s", "diverged", "confirmed", "sparse confirm / run", "full confirm / run",
                     "same causes"],
                    [[r["requests"], f"{r['run_s']:.1f}", r["diverged"], r["confirmed"], _ratio(r["sparse_ratio"]),
                      _ratio(r.get("full_ratio")), {True: "yes", False: "NO"}.get(r.get("same_causes"), "")]
                     for r in data.get("scale", [])])
        out += [f"\n{r['requests']} requests: {r['note']} (commit {str(r['meta']['git_commit'])[:7]})."
                for r in data.get("scale", []) if r.get("note")]
        pos = data.get("position", {}).get("rows", [])
        if pos:
            out += ["", f"One request of a {data['position']['requests']:,}-request trace:", ""]
            out += _rows(["where", "request", "confirm s", "confirmed", "its serial re-run s", "ratio"],
                         [[r["where"], r.get("request") or "-", f"{r['confirm_s']:.1f}" if r.get("request") else "-",
                           {True: "yes", False: "NO"}.get(r.get("confirmed"), "-"),
                           f"{r['serial_rerun_s']:.2f}" if r.get("request") else "-",
                           _ratio(r.get("ratio_to_rerun"))] for r in pos])
        return out
    if name == "confirm_live":
        r = data["live"]
        return _rows(["live requests", "model", "serve s", "serial re-run s", "diverged", "confirmed",
                      "sparse confirm s", "full confirm s"],
                     [[r["requests"], r["model"], f"{r['serve_s']:.1f}", f"{r['rerun_s']:.1f}", r["diverged"],
                       r["sparse_confirmed"], f"{r['sparse_s']:.1f}", f"{r['full_s']:.1f}" if "full_s" in r else "-"]])
    return ["(no table kept: see the JSON)"]


def render() -> str:
    out = ["# Performance", "",
           "Every figure on this page is read from `bench/results/` by `docs/gen_performance.py`: one JSON per "
           "bench and machine kind, the latest full run of that bench (older ones are in git history). Each "
           "bench prints its table and writes that JSON; `--quick` runs it small, to a temp dir, and CI runs "
           "every bench's `--quick` as a smoke test (`.ci/bench-smoke`). Speed goals live in the benches, never "
           "in timed tests.", "",
           "Read ratios as paired: each bench interleaves the engine and its reference in every repetition "
           "and reports medians of the per-repetition ratios. The CPU machine is shared, and the GPU machine "
           "is lent for a while at a time; runs of one tree on two leases have differed by up to 2x, so a "
           "single run does not settle a goal near 1.", ""]
    for name, (script, claim) in BENCHES.items():
        found = [(kind, RESULTS / kind / f"{name}.json") for kind in MACHINES]
        found = [(k, p) for k, p in found if p.exists()]
        out += [f"## {name}", "", f"`bench/{script}`: {claim}", ""]
        if not found:
            out += ["No result recorded yet: run the bench without `--quick` to record one.", ""]
        for kind, path in found:
            data = json.loads(path.read_text())
            rel = path.relative_to(ROOT).as_posix()
            out += [f"`{rel}`, " + machine_line(data.get("meta"), kind), ""]
            if data.get("merged"):
                out += [f"(This file also holds {data['merged']}.)", ""]
            out += table(name, data) + [""]
    unknown = sorted(p.relative_to(ROOT).as_posix() for p in RESULTS.rglob("*.json")
                     if p.stem not in BENCHES and p.parent.name in ("results", *MACHINES))
    if unknown:
        out += ["## Other results", "", *[f"- `{u}`" for u in unknown], ""]
    return "\n".join(out).rstrip("\n") + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/performance.md is out of date")
    args = ap.parse_args()
    text = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print("docs/performance.md is not what bench/results/ gives: run python docs/gen_performance.py",
                  file=sys.stderr)
            return 1
        return 0
    tmp = PAGE.with_suffix(".md.tmp")
    tmp.write_text(text)
    tmp.replace(PAGE)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
