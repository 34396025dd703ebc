"""`divergence replay TRACE.h5`: re-execute the recorded schedule exactly and report fidelity."""
from __future__ import annotations

from .common import emit_json

HELP = "re-execute a trace's exact schedule (optionally forcing kernels at steps) and report fidelity"


def add_arguments(p) -> None:
    p.add_argument("trace", metavar="TRACE.h5")
    p.add_argument("--force", action="append", default=[], metavar="STEP:KERNEL",
                   help="run STEP with KERNEL (gemv = every linear op row by row, gemm, gemm:S, native, "
                        "batch-invariant, threshold:N), one op with STEP:OP=KERNEL, or STEP:solo = each request "
                        "of the step alone, every op included (proves native causes); STEP:unsharded (or STEP:OP=unsharded) "
                        "= a tensor-parallel trace's sharded ops on the full weights, no all-reduce; repeatable")
    p.add_argument("--out", metavar="PATH", help="where the replayed trace goes (default: a temporary file)")
    p.add_argument("--model", metavar="DIR", help="model directory, if it moved since the trace was recorded")
    p.add_argument("--draft", metavar="DIR", help="draft model directory, if it moved")
    p.add_argument("--json", action="store_true", help="print a JSON report")


def main(args) -> int:
    from ..analysis.replay import replay
    from .paths import check_output_file

    if args.out:  # before any work: not the input trace, not a directory, in a writable place
        check_output_file(args.out, flag="--out", inputs=(args.trace,))
    r = replay(args.trace, force=args.force, out=args.out, model_dir=args.model, draft_dir=args.draft)
    if args.json:
        emit_json(r.to_json())
        return 0
    forced = ", ".join(f"step {k} -> {v}" for k, v in r.forced.items()) or "none"
    print(f"replayed {r.source} -> {r.out} (forced: {forced})")
    print(f"  {r.seconds:.2f} s (original steps took {r.original_seconds:.2f} s)")
    if r.faithful:
        what = ["tokens", "logits"] + (["KV hashes"] if r.kv_equal else []) + (["sampler draws"] if r.draws_equal else [])
        print(f"  faithful: {', '.join(what[:-1])} and {what[-1]} are bitwise equal")
    else:
        draws = "" if r.draws_equal is None else f", draws equal {r.draws_equal}"
        print(f"  differs: tokens equal {r.tokens_equal}, logits equal {r.logits_equal}, KV equal {r.kv_equal}{draws}")
        if r.first_difference:
            print(f"  first difference: request {r.first_difference['request']} at position "
                  f"{r.first_difference['position']}")
        if r.kv_first_difference and r.kv_first_difference.get("reason"):
            print(f"  first K/V difference: {r.kv_first_difference['reason']}")
    return 0
