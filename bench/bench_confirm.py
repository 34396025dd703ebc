"""Confirmation at scale: `bisect --confirm` of every diverged request against the `run` of
both schedules, with the sparse replay (analysis/sparse.py: only the steps a request needs)
and the full one (every replay the whole trace), and how confirming one request depends on
where it sits in the trace.

Workload (the issue's): the fixture models with the demo's settings (threshold:4, draft
k=3, max_tokens past end-of-text), prompts of 4-150 words, 32 tokens each, arrivals 3 steps
apart, N requests.

    python bench/bench_confirm.py [--quick] [--sizes 16,64,256] [--full-upto 16]
                                  [--position-n 1000] [--out FILE]

Table 1, per N: run (both schedules) s, diverged, confirmed, sparse confirm s and its ratio
to the run, full confirm s and ratio (N <= --full-upto), the same causes both ways.
Table 2 (a trace of --position-n requests): confirming one diverged request from the first,
middle and last tenth: seconds, and the ratio to that request's own serial re-run.
Writes bench/results/confirm.json.
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import common  # noqa: F401  (loads the BLAS before MLX)
from common import fmt, meta, out_path, table, write_json

from divergence import Trace
from divergence.analysis.pipeline import AnalysisOptions, analyze_pair
from divergence.analysis.replayer import Replayer
from divergence.core.request import Request
from divergence.fixtures import DRAFT, TARGET
from divergence.workloads.runner import RunConfig, load_models, run_schedules

WORDS = ("return the value of the object if it is not None else raise an error when the key is missing from "
         "the mapping and the list is empty so that each item in the sequence gets a new name for its index "
         "open a file and read its lines into a string with the given encoding").split()


def workload(encode, n: int, *, seed: int = 0, max_tokens: int = 32, gap: int = 3) -> list[Request]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 150))]
        out.append(Request(f"r{i + 1}", tuple(encode(" ".join(words))), max_tokens=max_tokens, arrival=gap * i))
    return out


def config() -> RunConfig:
    return RunConfig(model=TARGET, draft=DRAFT, policy="threshold:4", spec_k=3, stop_at_eos=False)


def record(n: int, out: Path, *, seed: int = 0) -> tuple[float, list[Request]]:
    cfg = config()
    target, draft = load_models(cfg)
    reqs = workload(target.encode, n, seed=seed)
    t0 = time.perf_counter()
    run_schedules(cfg, target, draft, reqs, ("serial", "concurrent"), out)
    return time.perf_counter() - t0, reqs


def confirm_all(out: Path, *, sparse: bool, requests=None):
    """(seconds, the report) of bisect --confirm over the pair (only `requests` when given)."""
    replayer = Replayer(sparse=sparse)
    opts = AnalysisOptions(confirm=True, make_replayer=lambda m, d: replayer, note=lambda s: None)
    with Trace.open(out / "serial.h5") as a, Trace.open(out / "concurrent.h5") as b:
        if requests is not None:
            opts.requests = list(requests)
        t0 = time.perf_counter()
        rep = analyze_pair(a, b, opts)
        return time.perf_counter() - t0, rep


def causes(rep) -> dict:
    out = {}
    for rid, c in rep.causes.items():
        f = rep.finding(rid)
        out[rid] = (c.kind, c.a.step, c.b.step, bool(f.confirmed), str(f.first_op.difference if f.first_op else None))
    return out


def scale_row(n: int, full_upto: int, work: Path) -> dict:
    out = work / f"n{n}"
    run_s, _ = record(n, out)
    sparse_s, rep = confirm_all(out, sparse=True)
    row = {"requests": n, "run_s": run_s, "diverged": len(rep.diff.diverged),
           "confirmed": sum(1 for p in rep.confirmations.values() if p.confirmed), "sparse_s": sparse_s,
           "sparse_ratio": sparse_s / run_s}
    if n <= full_upto:
        full_s, rep_full = confirm_all(out, sparse=False)
        row.update(full_s=full_s, full_ratio=full_s / run_s, same_causes=causes(rep) == causes(rep_full))
    return row


def serial_rerun_s(reqs: list[Request], rid: str, work: Path) -> float:
    """The request's own serial re-run: the request alone, traced, as `divergence rerun` runs it."""
    cfg = config()
    target, draft = load_models(cfg)
    one = [r for r in reqs if r.id == rid]
    one = [Request(r.id, r.prompt_tokens, max_tokens=r.max_tokens, sampling=r.sampling) for r in one]
    t0 = time.perf_counter()
    run_schedules(cfg, target, draft, one, ("serial",), work / f"rerun-{rid}")
    return time.perf_counter() - t0


def position_rows(n: int, work: Path) -> list[dict]:
    out = work / f"pos{n}"
    _, reqs = record(n, out)
    with Trace.open(out / "serial.h5") as a, Trace.open(out / "concurrent.h5") as b:
        from divergence.analysis.diff import diff_traces

        diverged = [r.id for r in diff_traces(a, b).diverged]
    index = {r.id: i for i, r in enumerate(reqs)}
    rows = []
    for name, lo, hi in (("first tenth", 0, n // 10), ("middle tenth", 9 * n // 20, 11 * n // 20),
                         ("last tenth", n - n // 10, n)):
        pick = next((r for r in diverged if lo <= index[r] < hi), None)
        if pick is None:
            rows.append({"where": name, "request": None})
            continue
        secs, rep = confirm_all(out, sparse=True, requests=[pick])
        c = rep.finding(pick)
        rerun = serial_rerun_s(reqs, pick, work)
        rows.append({"where": name, "request": pick, "confirm_s": secs, "confirmed": bool(c and c.confirmed),
                     "serial_rerun_s": rerun, "ratio_to_rerun": secs / rerun})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: 8 requests, position trace of 40")
    ap.add_argument("--sizes", default="16,64,256")
    ap.add_argument("--full-upto", type=int, default=16, help="also time the full replay up to this many requests")
    ap.add_argument("--position-n", type=int, default=1000)
    ap.add_argument("--out")
    args = ap.parse_args()
    sizes = [8] if args.quick else [int(x) for x in args.sizes.split(",") if x]
    pos_n = 40 if args.quick else args.position_n
    with tempfile.TemporaryDirectory(prefix="bench-confirm-") as tmp:
        work = Path(tmp)
        scale = [scale_row(n, args.full_upto, work) for n in sizes]
        print(table([[r["requests"], fmt(r["run_s"]), r["diverged"], r["confirmed"], fmt(r["sparse_s"]),
                      fmt(r["sparse_ratio"]), fmt(r.get("full_s")), fmt(r.get("full_ratio")),
                      fmt(r.get("same_causes"))] for r in scale],
                    ["requests", "run s", "diverged", "confirmed", "sparse s", "sparse/run", "full s",
                     "full/run", "same causes"]))
        pos = position_rows(pos_n, work) if pos_n else []
        if pos:
            print()
            print(table([[r["where"], r["request"] or "-", fmt(r.get("confirm_s")), fmt(r.get("confirmed")),
                          fmt(r.get("serial_rerun_s")), fmt(r.get("ratio_to_rerun"))] for r in pos],
                        ["where", "request", "confirm s", "confirmed", "serial re-run s", "ratio"]))
    write_json(out_path("confirm", args.quick, args.out),
               {"meta": meta(args), "scale": scale, "position": {"requests": pos_n, "rows": pos}})


if __name__ == "__main__":
    main()
