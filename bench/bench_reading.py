"""Memory of diff and bisect on large traces: whole-table reads vs range reads (trace/ranged.py).

    python bench/bench_reading.py --quick          # 0.05 and 0.2 GB traces (results to a temp dir)
    python bench/bench_reading.py                  # 0.5, 2 and 10 GB (bench/results/reading.json)
    python bench/bench_reading.py --sizes-gb 10    # any sizes

For each size, a pair of synthetic live-server traces (no model: this engine's tables as a
0.5B-shaped server writes them, 24 layers, 32 requests at a time, 64-token prompts, 128
tokens each, K/V hashes, kernel records, top-8 logits; B differs from A in every 500th request:
a K/V write at its 10th decode step, its logits from the 12th, a token at the 16th), written
through TraceWriter's bulk appends. Then each command runs in a child process, and its peak
RSS (VmHWM) and wall time are measured:

* `diff` and `bisect --json` (no replay: the traces have no model), ranged (the default from
  trace/ranged.LARGE_BYTES up; forced here at every size);
* the same with `--requests` naming 2 diverged requests;
* `diff` with whole-table reads (trace/ranged.LARGE_BYTES raised past the file), for the
  ratio; skipped past --whole-max-gb (it loads every table: tens of GB of RAM).

The goal (issue 46): <= 1 GB RSS for a 10 GB trace; the bounded commands' RSS should stay flat
as the trace grows. Traces go to --dir (default a temp dir; removed unless --keep).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from divergence.core.events import RunInfo  # noqa: E402
from divergence.core.request import Request  # noqa: E402
from divergence.trace import schema as S  # noqa: E402
from divergence.trace.writer import TraceWriter  # noqa: E402

LAYERS, CONC, PROMPT, GEN, TOPK = 24, 32, 64, 128, 8
OPS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "attention")
BLOCK_STEPS = 256  # steps generated and appended at once
EVERY = 500  # B differs from A in every EVERY-th request
GOAL_GB = 1.0
OP_CODES = np.array([S.CODE_TABLES["ops"].index(o) for o in OPS + ("lm_head",)], np.int8)


def _lives(n_steps: int):
    """Slot s runs requests s, s + CONC, ... back to back, 1 prefill step + GEN decode steps
    each, staggered: request r arrives at step start[r]."""
    life = GEN + 1
    per_slot = n_steps // life + 1
    n_req = per_slot * CONC
    r = np.arange(n_req)
    start = (r // CONC) * life + (r % CONC) * life // CONC
    return n_req, start


VOCAB = 32000


def _requests(n_req: int, start: np.ndarray) -> list[Request]:
    prompts = np.random.default_rng(1).integers(0, VOCAB, (n_req, PROMPT))
    return [Request(f"cmpl-{i:07d}", tuple(prompts[i].tolist()), max_tokens=GEN, arrival=int(start[i]))
            for i in range(n_req)]


def _info(schedule: str) -> RunInfo:
    """A live server's run: no requests at its start (each joins as it arrives: /live_requests)."""
    return RunInfo(schedule=schedule, policy="native", settings={"top_k": TOPK, "spec_k": 0, "serve": {}},
                   requests=[], model={"path": "/synthetic", "weights_hash": "synthetic", "dtype": "bfloat16"},
                   draft=None, environment={}, vocab=[f"t{i}" for i in range(VOCAB)])


def write_trace(path: Path, n_steps: int, *, perturbed: bool) -> None:
    """A live-server-shaped trace of n_steps steps (the same for A and B but where `perturbed`)."""
    n_req, start = _lives(n_steps)
    w = TraceWriter(path, top_k=TOPK, background=True)
    w.on_run_start(_info("concurrent" if perturbed else "serial"))
    requests = _requests(n_req, start)
    joined = 0
    rng = np.random.default_rng(7)
    off = {"slice": 0, "tok": 0, "logit": 0, "hash": 0}
    life = GEN + 1
    for s0 in range(0, n_steps, BLOCK_STEPS):
        steps = np.arange(s0, min(n_steps, s0 + BLOCK_STEPS))
        while joined < n_req and start[joined] <= steps[-1]:  # arrivals (in order of arrival)
            w.on_request_added(requests[joined])
            joined += 1
        # the requests of each step: one per slot
        slot = np.arange(CONC)
        j = (steps[:, None] - slot[None, :] * life // CONC) // life  # [S, C]
        live = j >= 0
        req = np.where(live, j * CONC + slot[None, :], -1)
        age = np.where(live, steps[:, None] - start[np.maximum(req, 0)], -1)  # 0: prefill, 1..GEN: decode
        st, sl = np.nonzero(live)
        r, a, step = req[st, sl], age[st, sl], steps[st]
        count = np.where(a == 0, PROMPT, 1).astype(np.int32)
        pos = np.where(a == 0, 0, PROMPT + a - 1).astype(np.int32)
        n = len(r)
        # steps and slices
        per_step = np.bincount(st, minlength=len(steps))
        rows = np.bincount(st, weights=count, minlength=len(steps)).astype(np.int32)
        w.append("steps", index=steps, model=0, duration=0.01, rows=rows,
                 slice_offset=off["slice"] + np.concatenate([[0], np.cumsum(per_step)[:-1]]), slice_count=per_step)
        tok_off = off["tok"] + np.concatenate([[0], np.cumsum(count)[:-1]])
        row_off = np.concatenate([[0], np.cumsum(count)[:-1]]) - np.repeat(
            np.concatenate([[0], np.cumsum(rows)[:-1]]), per_step)
        w.append("slices", step=step, request=r, phase=np.where(a == 0, 0, 1), start=pos, count=count,
                 row_offset=row_off, token_offset=tok_off, logit_offset=off["logit"] + np.arange(n), logit_count=1)
        w.append("slice_tokens", value=rng.integers(0, VOCAB, int(count.sum())).astype(np.int32))
        w.append("slice_logit_rows", value=count - 1)
        off["slice"] += n
        off["tok"] += int(count.sum())
        off["logit"] += n
        # kernels: every op of every layer, and lm_head
        ks = np.repeat(steps, LAYERS * len(OPS) + 1)
        layer = np.tile(np.r_[np.repeat(np.arange(LAYERS), len(OPS)), LAYERS], len(steps))
        op = np.tile(np.r_[np.tile(np.arange(len(OPS)), LAYERS), len(OPS)], len(steps))
        m = np.repeat(rows, LAYERS * len(OPS) + 1)
        w.append("kernels", step=ks, model=0, layer=layer, op=OP_CODES[op], kernel="native", m=m, n=896, k=896)
        # K/V writes: per slice and layer, hashes per position
        kr = np.repeat(np.arange(n), LAYERS)
        kcount = count[kr]
        hoff = off["hash"] + np.concatenate([[0], np.cumsum(kcount)[:-1]])
        w.append("kv_writes", step=step[kr], model=0, request=r[kr], layer=np.tile(np.arange(LAYERS), n),
                 start=pos[kr], count=kcount, hash_offset=hoff)
        nh = int(kcount.sum())
        kh, vh = rng.integers(0, 2**63, nh, dtype=np.int64), rng.integers(0, 2**63, nh, dtype=np.int64)
        if perturbed:  # the K/V of a perturbed request's 10th decode step, and everything after it
            bad = np.repeat((r[kr] % EVERY == 0) & (a[kr] >= 10), kcount)
            kh[bad] ^= 1
        w.append("kv_hashes", k_hash=kh.view(np.uint64), v_hash=vh.view(np.uint64))
        off["hash"] += nh
        # tokens: one per slice (a prefill's first token, a decode's next)
        ids = (np.argsort(rng.random((n, 50)), axis=1)[:, :TOPK] * 601 % VOCAB).astype(np.int32)
        logits = np.sort(rng.normal(10, 2, (n, TOPK)).astype(np.float32), axis=1)[:, ::-1]
        token = ids[:, 0].copy()
        if perturbed:
            drift = (r % EVERY == 0) & (a >= 12)
            logits[drift] = np.nextafter(logits[drift], np.float32(100))
            flip = (r % EVERY == 0) & (a == 16)
            token[flip] = ids[flip, 1]
        w.append("tokens", step=step, request=r, position=pos + count, token=token, spec=0, topk_ids=ids,
                 topk_logits=np.ascontiguousarray(logits), logit=logits[:, 0], prob=0.5)
        first, last = a == 0, a == GEN
        w.append("request_events", step=step[first], request=r[first], kind="arrived")
        w.append("request_events", step=step[last], request=r[last], kind="finished")
        w.flush()
    w.close(completed=True)


CHILD = """
import json, os, sys, time
sys.path.insert(0, {root!r})
import divergence.trace.ranged as R
R.LARGE_BYTES = 1 << 62 if {whole} else 0  # whole tables, or ranges at any size
from divergence.cli.main import main
t0 = time.perf_counter()
sys.stdout = open(os.devnull, "w")
code = main({argv!r})
hwm = next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM:"))  # kB, since exec
sys.stderr.write(json.dumps({{"code": code, "seconds": time.perf_counter() - t0, "rss_gb": hwm / 2**20}}) + "\\n")
"""


def measure(argv: list[str], *, whole: bool = False) -> dict:
    """Run a divergence command in a child: its exit code, wall seconds and peak RSS (GB: the
    child's VmHWM, its own process's peak; a child's ru_maxrss would count this process's
    memory, which the child had until its exec)."""
    p = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT), whole=whole, argv=argv)],
                       stderr=subprocess.PIPE, text=True)
    last = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else "{}"
    try:
        return json.loads(last)
    except ValueError:
        raise SystemExit(f"{' '.join(argv)} failed:\n{p.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="0.05 and 0.2 GB traces; JSON to a temp dir")
    ap.add_argument("--sizes-gb", help="comma-separated trace sizes in GB (default: 0.5,2,10; --quick 0.05,0.2)")
    ap.add_argument("--whole-max-gb", type=float, help="read whole tables only up to this size (default 0.6; "
                    "--quick 0.1): they take some 7 times the trace in memory")
    ap.add_argument("--dir", help="where the traces go (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the traces")
    ap.add_argument("--out", help="JSON path (default: bench/results/reading.json; --quick: a temp dir)")
    args = ap.parse_args()
    sizes = [float(x) for x in (args.sizes_gb or ("0.05,0.2" if args.quick else "0.5,2,10")).split(",")]
    work = Path(args.dir or tempfile.mkdtemp(prefix="divergence-reading-"))
    work.mkdir(parents=True, exist_ok=True)
    per_step = None
    results = []
    try:
        for gb in sizes:
            a, b = work / f"a-{gb}.h5", work / f"b-{gb}.h5"
            if per_step is None:  # bytes a step takes: from a small trace
                probe = work / "probe.h5"
                write_trace(probe, 2000, perturbed=False)
                per_step = probe.stat().st_size / 2000
                probe.unlink()
            n_steps = int(gb * 2**30 / per_step)
            t0 = time.perf_counter()
            if not (a.exists() and b.exists()):
                write_trace(a, n_steps, perturbed=False)
                write_trace(b, n_steps, perturbed=True)
            made = time.perf_counter() - t0
            n_req, _ = _lives(n_steps)
            chosen = f"cmpl-{0:07d},cmpl-{EVERY * (n_req // EVERY // 2):07d}"  # two diverged: the first, a middle one
            row = {"size_gb": a.stat().st_size / 2**30, "steps": n_steps, "requests": n_req,
                   "write_seconds": made}
            cmds = {"diff": ["diff", str(a), str(b), "--json"],
                    "bisect": ["bisect", str(a), str(b), "--json"],
                    "diff --requests": ["diff", str(a), str(b), "--json", "--requests", chosen],
                    "bisect --requests": ["bisect", str(a), str(b), "--json", "--requests", chosen]}
            for name, argv in cmds.items():
                row[name] = measure(argv)
            if row["size_gb"] <= (args.whole_max_gb or (0.1 if args.quick else 0.6)):
                row["diff (whole tables)"] = measure(cmds["diff"], whole=True)
            results.append(row)
            _print(results)
            if not args.keep:
                a.unlink()
                b.unlink()
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    out = Path(args.out) if args.out else (Path(tempfile.gettempdir()) / "divergence-bench" / "quick" / "reading.json"
                                           if args.quick else ROOT / "bench" / "results" / "reading.json")
    write_results(out, results, args)


def write_results(out: Path, results: list[dict], args) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    bounded = [r[c]["rss_gb"] for r in results for c in BOUNDED]
    data = {"bench": "reading", "goal": f"<= {GOAL_GB} GB RSS for diff and bisect of a 10 GB trace",
            "shape": {"layers": LAYERS, "concurrent": CONC, "prompt": PROMPT, "generated": GEN, "top_k": TOPK},
            "meta": meta(args), "max_bounded_rss_gb": max(bounded), "table": table_lines(results),
            "results": results}
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"[bench] wrote {out}")


def meta(args) -> dict:
    """When, at which commit, where (bench/common.meta's keys that need no MLX)."""
    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git_commit": git("rev-parse", "HEAD"),
            "engine_tree_dirty": bool(git("status", "--porcelain", "--", "divergence")),
            "python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "argv": sys.argv[1:], "args": dict(vars(args)) if args is not None else {}}


BOUNDED = ("diff", "bisect", "diff --requests", "bisect --requests")


def table_lines(results: list[dict]) -> list[str]:
    """Peak RSS and wall time of each command at each size (the goal: <= GOAL_GB at 10 GB)."""
    cols = BOUNDED + ("diff (whole tables)",)
    lines = [f"{'trace GB':>8} {'requests':>9}  " + "  ".join(f"{c:>22}" for c in cols)]
    for r in results:
        cells = []
        for c in cols:
            m = r.get(c)
            cells.append(f"{m['rss_gb']:6.2f} GB {m['seconds']:7.1f} s exit {m['code']}" if m else f"{'-':>22}")
        lines.append(f"{r['size_gb']:8.2f} {r['requests']:9d}  " + "  ".join(f"{x:>22}" for x in cells))
    lines.append(f"(peak RSS and wall time of each command in a child process; goal <= {GOAL_GB} GB at 10 GB; "
                 f"'whole tables' reads every table, as traces under trace/ranged.LARGE_BYTES are read)")
    return lines


def _print(results: list[dict]) -> None:
    print("\n".join(table_lines(results)))


if __name__ == "__main__":
    main()
