"""`divergence sweep`: one prompt N times in varied batches; count unique completions."""
from __future__ import annotations

import sys

from ..core.rules import at_least_one
from .common import add_model_args, default_model_dirs, emit_json

HELP = ("run one prompt (greedy) N times in one continuous-batching stream, each copy inside batches of "
        "other requests of random size and composition, and count how many different completions it gets: "
        "1 means batching never changed it (the measure Thinking Machines and vLLM report)")
DEFAULT_PROMPT = "Return the number of"


def add_arguments(p) -> None:
    add_model_args(p, draft=False)
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the prompt to repeat (text)")
    p.add_argument("-n", type=int, default=20, help="number of runs: copies of the prompt in the stream (default 20)")
    p.add_argument("--policy", help="kernel policy (default: native with --model, threshold:4 without)")
    p.add_argument("--max-batch", type=int, default=8,
                   help="largest batch (default 8): the most requests the stream plans into one step")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens generated per run (default 48)")
    p.add_argument("--seed", type=int, default=0, help="seed for batch sizes, co-batched prompts and arrivals")
    p.add_argument("--json", action="store_true", help="print a JSON report")


def main(args) -> int:
    # (lazy: loads numpy and h5py; the parser imports every command)
    from ..workloads.runner import RunConfig, load_models, make_engine
    from ..workloads.sweep import check_args, sweep

    at_least_one("--max-tokens", args.max_tokens)
    check_args(args.prompt, args.n, args.max_batch, args.max_tokens)  # before the model loads
    target_dir, _ = default_model_dirs()
    policy = args.policy or ("threshold:4" if args.model is None else "native")
    cfg = RunConfig(model=args.model or target_dir, dtype=args.dtype, policy=policy)
    target, _ = load_models(cfg)
    engine = make_engine(cfg)

    from .progress import on_tty  # (lazy: loads numpy; the parser imports every command)

    tty = on_tty() and not args.json  # progress belongs on a terminal: a pipe gets no \r

    def progress(i, n):
        if tty:
            print(f"\rrun {i}/{n} done", end="", file=sys.stderr, flush=True)

    r = sweep(engine, args.prompt, runs=args.n, max_batch=args.max_batch, max_tokens=args.max_tokens,
              seed=args.seed, progress=progress)
    if args.json:
        emit_json(r.to_json())
        return 0
    if tty:
        print("\r\x1b[K", end="", file=sys.stderr, flush=True)
    print(f"{r.runs} runs of {r.prompt!r} under {r.policy}, batches of 1..{args.max_batch}: "
          f"{r.unique} unique completion{'s' if r.unique != 1 else ''}")
    print(f"  one stream: {r.runs} needles + {r.fillers} co-batched requests, {r.steps} steps; "
          f"batch sizes seen {min(r.batch_sizes)}..{max(r.batch_sizes)}")
    for count, at, tail in zip(r.counts, r.diverge_at, r.tails):
        where = "same as the needle alone" if at is None else f"from generated #{at}: ...{tail[:60]!r}"
        print(f"  {count:>4} x  {where}")
    if r.first_difference:
        where = ", ".join(f"#{k}: {v}" for k, v in sorted(r.first_difference.items()))
        print(f"  first differs from the needle run alone at generated token {where}")
    return 0
