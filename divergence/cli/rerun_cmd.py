"""`divergence rerun`: re-run a live trace's requests under another schedule (the reference)."""
from __future__ import annotations

import sys

from ..core.names import BASE_SCHEDULES, SERIAL
from ..errors import PromptError
from .paths import check_output_dir, remember_outputs

HELP = ("re-run the requests of a live trace (divergence serve) under another schedule: the reference trace "
        "(a trace of serve --engine mlx-lm re-runs on mlx-lm's BatchGenerator, serially, its greedy requests)")


def add_arguments(p) -> None:
    p.add_argument("live", metavar="LIVE.h5", help="a trace that divergence serve wrote")
    p.add_argument("--schedule", default=SERIAL, choices=BASE_SCHEDULES,
                   help="the schedule of the re-run")
    p.add_argument("--requests", metavar="ID,...", help="re-run only these requests; the trace names them, and "
                   "diff, bisect and report compare only these")
    p.add_argument("--out", metavar="DIR", required=True, help="a directory: SCHEDULE.h5 goes there (an existing "
                   "SCHEDULE.h5 is replaced only if it is rerun's own earlier output, unchanged since)")
    p.add_argument("--model", metavar="DIR", help="model directory, if it moved since the trace was recorded")
    p.add_argument("--draft", metavar="DIR", help="draft model directory, if it moved")


def main(args) -> int:
    from ..serve.rerun import NOT_CHOSEN, rerun  # (lazy: loads MLX; the parser imports every command)
    from ..trace.reader import Trace  # (lazy: loads numpy and h5py; the parser imports every command)

    Trace.open(args.live).close()  # not a trace: one line, before anything loads
    check_output_dir(args.out, files=[f"{args.schedule}.h5"], inputs=[args.live], command="rerun")
    ids = None
    if args.requests is not None:
        ids = [i.strip() for i in args.requests.split(",") if i.strip()]
        if not ids:
            raise PromptError("--requests names no request")
    from .progress import rerun_progress  # (lazy: loads numpy; the parser imports every command)

    with rerun_progress(args.live, ids) as observers:  # on a terminal: 're-running serially: step 120, 340 tokens'
        path, result, skipped = rerun(args.live, args.out, schedule=args.schedule, request_ids=ids,
                                      model_dir=args.model, draft_dir=args.draft, observers=observers)
    remember_outputs([path], command="rerun")
    ran = len(result.outputs) - len(skipped)
    print(f"{args.schedule:<11} {ran} requests, {result.generated_tokens} tokens, {result.steps} steps "
          f"({result.target_steps} target), {result.seconds:.1f} s -> {path}")
    for src, readers in (getattr(result, "prefix_sources", None) or {}).items():
        print(f"  also re-ran {src}: {', '.join(readers)} read its prefix-cache blocks")
    missing = [rid for rid, why in skipped.items() if why == NOT_CHOSEN]
    for rid, why in [(r, w) for r, w in skipped.items() if w != NOT_CHOSEN][:10]:
        print(f"  left out {rid}: {why}", file=sys.stderr)
    if missing:
        chosen = [rid for rid in result.outputs if rid not in skipped]
        print(f"note: diff, bisect and report compare the {len(chosen)} re-run ({_some(chosen)}); the "
              f"{len(missing)} not re-run ({_some(missing)}) are left out of the comparison")
    print(f"next: divergence bisect {path} {args.live} --confirm")
    return 0


def _some(ids: list[str]) -> str:
    return ", ".join(ids[:3]) + (f" and {len(ids) - 3} more" if len(ids) > 3 else "")
