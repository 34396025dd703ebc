"""Confirmation at scale: `bisect --confirm` of every diverged request against the `run` of
both schedules, with the sparse replay (analysis/sparse.py: only the steps a request needs)
and the full one (every replay the whole trace), and how confirming one request depends on
where it sits in the trace.

Workload (the issue's): the fixture models with the demo's settings (threshold:4, draft
k=3, max_tokens past end-of-text), prompts of 4-150 words, 32 tokens each, arrivals 3 steps
apart, N requests.

    python bench/bench_confirm.py [--quick] [--sizes 16,64,256] [--full-upto 16]
                                  [--position-n 1000] [--out FILE]
    python bench/bench_confirm.py --live 24 [--model qwen0.5b|DIR] [--policy native] [--out FILE]

Table 1, per N: run (both schedules) s, diverged, confirmed, sparse confirm s and its ratio
to the run, full confirm s and ratio (N <= --full-upto), the same causes both ways.
Table 2 (a trace of --position-n requests): confirming one diverged request from the first,
middle and last tenth: seconds, and the ratio to that request's own serial re-run.
--live N: real HTTP traffic instead (the issue's H200 case): `divergence serve` on the model,
N concurrent completions, the server stopped, `divergence rerun --schedule serial` of its
trace, then bisect --confirm of the pair, sparse and full, timed against the serving time.
Writes bench/results/confirm.json (--live: confirm_live.json; on a GPU under results/cuda/).
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


def live(args, work: Path) -> dict:
    """Serve N concurrent requests, re-run the trace serially, confirm every divergence."""
    import concurrent.futures as cf
    import os
    import signal
    import subprocess
    import sys

    import httpx

    from divergence.parallel.launch import free_ports

    if args.model == "qwen0.5b":
        model, draft, policy = common.qwen_path(TARGET), None, args.policy or "native"
    elif args.model:
        model, draft, policy = Path(args.model), None, args.policy or "native"
    else:  # the fixture: a CPU's own kernels are batch-invariant, so the demo's policy and draft
        model, draft, policy = TARGET, DRAFT, args.policy or "threshold:4"
    [port] = free_ports(1)
    cmd = [sys.executable, "-m", "divergence", "serve", "--model", str(model), "--port", str(port),
           "--trace-dir", str(work / "live"), "--policy", policy, "--ignore-eos"]
    cmd += ["--draft", str(draft)] if draft else []
    env = dict(os.environ, PYTHONPATH=str(common.ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    work.mkdir(parents=True, exist_ok=True)
    log = open(work / "serve.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start: {(work / 'serve.log').read_text()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        served = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        rng = random.Random(1)
        texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 150))) for _ in range(args.live + 1)]

        def one(i: int):
            r = httpx.post(url + "/v1/completions", json={"model": served, "prompt": texts[i], "max_tokens": 64},
                           timeout=600)
            if r.status_code != 200:
                raise SystemExit(f"the server answered {r.status_code}: {r.text[:300]}")
            return r.json()["id"]

        one(-1)  # warm-up: the first request compiles what the rest reuse
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(args.live) as ex:
            ids = list(ex.map(one, range(args.live)))
        serve_s = time.perf_counter() - t0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    [trace] = sorted((work / "live").glob("*.h5"))
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "divergence", "rerun", str(trace), "--schedule", "serial",
                    "--out", str(work / "rerun")], check=True, env=env, capture_output=True)
    rerun_s = time.perf_counter() - t0
    [serial] = sorted((work / "rerun").glob("*.h5"))
    row = {"requests": args.live, "model": str(args.model or "fixture"), "policy": policy, "serve_s": serve_s,
           "rerun_s": rerun_s}
    for sparse in (True, False) if not args.no_full else (True,):
        replayer = Replayer(sparse=sparse)
        opts = AnalysisOptions(confirm=True, make_replayer=lambda m, d: replayer, note=lambda s: None,
                               requests=ids)
        with Trace.open(serial) as a, Trace.open(trace) as b:
            t0 = time.perf_counter()
            rep = analyze_pair(a, b, opts)
            secs = time.perf_counter() - t0
        name = "sparse" if sparse else "full"
        row.update({f"{name}_s": secs, f"{name}_confirmed": sum(1 for p in rep.confirmations.values() if p.confirmed),
                    "diverged": len(rep.diff.diverged), f"{name}_causes": causes(rep)})
    if "full_causes" in row:
        row["same_causes"] = row.pop("full_causes") == row["sparse_causes"]
    row.pop("sparse_causes", None)
    print(table([[row["requests"], fmt(serve_s), fmt(rerun_s), row["diverged"], row["sparse_confirmed"],
                  fmt(row["sparse_s"]), fmt(row.get("full_s")), fmt(row.get("same_causes"))]],
                ["live requests", "serve s", "serial rerun s", "diverged", "confirmed", "sparse confirm s",
                 "full confirm s", "same causes"]))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: 4 requests, position trace of 10")
    ap.add_argument("--sizes", default="16,64,256")
    ap.add_argument("--full-upto", type=int, default=16, help="also time the full replay up to this many requests")
    ap.add_argument("--position-n", type=int, default=1000)
    ap.add_argument("--live", type=int, help="N concurrent requests through divergence serve instead")
    ap.add_argument("--model", help="--live: a model dir, or qwen0.5b (a random 0.5B-shaped bf16 model)")
    ap.add_argument("--policy", help="--live: the server's kernel policy (default native; the fixture: threshold:4)")
    ap.add_argument("--no-full", action="store_true", help="--live: skip the full replay")
    ap.add_argument("--work", help="--live: keep the traces in this directory")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.live:
        if args.work:
            row = live(args, Path(args.work))
        else:
            with tempfile.TemporaryDirectory(prefix="bench-confirm-live-") as tmp:
                row = live(args, Path(tmp))
        gpu = "gpu" in str(common.mx.default_device()).lower()
        name = ("cuda/" if gpu else "") + "confirm_live"
        write_json(out_path(name, args.quick, args.out), {"meta": meta(args), "live": row})
        return
    sizes = [4] if args.quick else [int(x) for x in args.sizes.split(",") if x]
    pos_n = 10 if args.quick else args.position_n
    if args.quick:
        args.full_upto = min(args.full_upto, 4)
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
