"""Trace mlx-lm's own BatchGenerator (serial: one request at a time; concurrent: all
at once), then bisect: its divergences get root causes like the engine's.

    python examples/batch_generator_trace.py --model DIR --prompts P.jsonl --max-tokens 64 \\
        --out traces/bg [--json bg.json]

    python examples/batch_generator_trace.py --quick     # the fixture, 4 built-in prompts, 12 tokens

Prints the bisect report; --json writes {tokens diverged, causes} plus bisect's JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from divergence.analysis.bisect import bisect_traces  # noqa: E402
from divergence.analysis.report import render_bisect  # noqa: E402
from divergence.engine.model.loading import load_model  # noqa: E402
from divergence.workloads.mlxlm_batch import run_batch_generator  # noqa: E402
from divergence.workloads.prompts import load_prompts  # noqa: E402
from divergence.trace.reader import Trace  # noqa: E402
from divergence.trace.writer import TraceWriter  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default=None, help="default: the embedded fixture")
    ap.add_argument("--prompts", default=None, help="default: four short prompts")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 64 (--quick: 12)")
    ap.add_argument("--out", default=None, help="trace folder (default: a temp dir)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.model is None:
        from divergence.fixtures import TARGET

        args.model = str(TARGET)
    args.max_tokens = args.max_tokens or (12 if args.quick else 64)
    tmp = Path(tempfile.mkdtemp(prefix="divergence-bg-"))
    args.out = args.out or tmp / "traces"
    if args.prompts is None:
        args.prompts = tmp / "prompts.jsonl"
        args.prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(
            ["Return the number of", "This module provides", "Open file and", "def main():"])))
    loaded = load_model(args.model)
    reqs = load_prompts(args.prompts, loaded.encode, max_tokens=args.max_tokens)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seconds = {}
    for schedule in ("serial", "concurrent"):
        t0 = time.perf_counter()
        with TraceWriter(out / f"{schedule}.h5", top_k=8, kv_hashes=True) as w:
            run_batch_generator(loaded, reqs, schedule, [w])
        seconds[schedule] = round(time.perf_counter() - t0, 2)
    with Trace.open(out / "serial.h5") as a, Trace.open(out / "concurrent.h5") as b:
        report = bisect_traces(a, b)
        print(render_bisect(report, a.vocab))
        j = report.to_json()
    diverged = [r for r in j["requests"] if r["status"] == "diverged"]
    summary = {"engine": "mlx-lm BatchGenerator", "model": args.model, "requests": len(j["requests"]),
               "tokens_diverged": len(diverged),
               "logits_differ": sum(r["first_numeric_divergence"] is not None for r in j["requests"]),
               "root_causes": sum(r["root_cause"] is not None for r in diverged), "seconds": seconds}
    print(json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "bisect": j}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
