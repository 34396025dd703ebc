"""`divergence run`: run the same requests under several schedules, one trace each."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from ..core.rules import at_least_one, schedules as parse_schedules
from ..core.settings import DEFAULT_TOKEN_BUDGET, DEFAULT_TOP_K
from ..errors import DivergenceInputError, PromptError
from ..parallel.env import is_writer
from ..parallel.ranks import tp_degree
from ..workloads.prompts import builtin_requests, load_prompts, sampling_defaults
from .common import add_model_args, default_model_dirs, emit_json
from .paths import check_output_dir, remember_outputs

HELP = "run requests under serial and concurrent schedules and record a trace of each"
DEMO_POLICY = "threshold:4"
DEMO_SPEC_K = 3  # verify = 4 rows: alone they run gemv under threshold:4, batched with a prefill gemm


def add_arguments(p) -> None:
    add_model_args(p)
    p.add_argument("--prompts", metavar="FILE.jsonl", help="JSON Lines, one request a line: {\"id\", \"prompt\" (any "
                   "JSON string) or \"tokens\", \"max_tokens\", \"arrival\", \"temperature\", \"top_p\", \"seed\" (any "
                   "integer, taken mod 2**63)}; docs/prompts.md (default: built-in set)")
    p.add_argument("--schedules", default="serial,concurrent", help="comma-separated: serial, concurrent, warm")
    p.add_argument("--policy", help="kernel policy: native | batch-invariant | threshold:N "
                   "(default: native with --model; threshold:4 in the demo)")
    p.add_argument("--spec-k", type=int, help="draft tokens per verify (0 = off; demo default 3)")
    p.add_argument("--max-tokens", type=int, help="tokens to generate per request (default: per request, or 64)")
    p.add_argument("--token-budget", type=int, default=DEFAULT_TOKEN_BUDGET, help="rows per engine step (concurrent)")
    p.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, help="top-k logits recorded per token")
    p.add_argument("--temperature", type=float, metavar="T", help="sampling temperature of every request whose "
                   "prompt line sets none (default: 0, greedy)")
    p.add_argument("--top-p", type=float, metavar="P", help="nucleus top-p, 0 < P <= 1, of every request whose "
                   "prompt line sets none (default: 1)")
    p.add_argument("--seed", type=int, metavar="S", help="sampling seed of every request whose prompt line sets "
                   "none (default: 0); any integer, taken mod 2**63 (docs/prompts.md)")
    p.add_argument("--prefix-cache", action="store_true", help="reuse cached KV blocks of shared prompt prefixes")
    p.add_argument("--prefill", choices=("whole", "mlx-lm"), default="whole",
                   help="where the prompt's last token is computed: in the prefill (whole, default) or in the "
                        "first decode step as mlx-lm does (mlx-lm: one request then gets mlx-lm's numbers exactly)")
    p.add_argument("--no-kv-hashes", action="store_true", help="don't record KV-write hashes")
    p.add_argument("--ignore-eos", action="store_true", default=None,
                   help="generate max_tokens even past end-of-text (on in the demo, so divergences have room)")
    p.add_argument("--tp", type=int, metavar="N", help="tensor parallelism: shard the models over N ranks "
                   "(started here over 127.0.0.1, or the group mlx.launch started); rank 0 writes the traces")
    p.add_argument("--blas-core", metavar="CORE", help="run OpenBLAS's kernels for CORE (Haswell, Zen, SkylakeX, "
                   "Cooperlake, ...; OPENBLAS_CORETYPE) instead of its pick for this CPU: a run as another machine "
                   "would make it (see the environment cause in docs/reading-a-report.md)")
    p.add_argument("--blas-threads", type=int, metavar="N", help="run OpenBLAS on N threads (default: its own "
                   "count); the count changes fp32 bits on some cores")
    p.add_argument("--out", metavar="DIR", default="traces", help="a directory: one SCHEDULE.h5 trace per "
                   "schedule goes there (default ./traces); an existing SCHEDULE.h5 is replaced only if it is "
                   "run's own earlier output, unchanged since: never a trace run did not write there")
    p.add_argument("--json", action="store_true", help="print a JSON report")
    p.add_argument("--check", action="store_true", help="exit 1 when the schedules diverge (for CI; without it "
                   "a run that recorded its traces exits 0, diverged or not)")


def main(args) -> int:
    # (lazy: the parser imports every command; numpy, h5py, the BLAS and MLX load only to run one)
    from ..engine.kernels import blas
    from ..workloads.runner import load_models, make_engine, run_schedules, validate

    if blas.blas_problem():  # DIVERGENCE_BLAS names nothing loadable: say so, don't run on another BLAS
        raise DivergenceInputError(blas.blas_problem())
    plan = plan_run(args)
    target, draft = load_models(plan.cfg)
    requests = load_requests(args, target.encode, plan.sampling)
    engine = make_engine(plan.cfg)
    validate(engine, requests)  # before anything is written; run_schedules takes the checked engine
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr))
    say(f"model {target.path} ({target.config.get('model_type')}, {target.dtype})"
        + (f", draft {draft.path}, spec k={plan.spec_k}" if draft else "") + f", policy {plan.policy}")
    blas_threads = check_blas_request(args, blas)
    describe_setup(say, blas, blas_threads, plan)
    out = Path(args.out)
    with blas.using_blas_threads(blas_threads):
        results = run_schedules(plan.cfg, target, draft, requests, plan.schedules, out, progress=not args.json,
                                engine=engine)
    if not is_writer():
        return 0  # tensor parallel: ranks other than 0 compute along, rank 0 writes and reports
    paths = {s: str(out / f"{s}.h5") for s in plan.schedules}
    remember_outputs(paths.values(), command="run")  # its next run may replace them
    diffs = diff_schedules(paths, plan.schedules)
    identical = all(d.identical for d in diffs.values())
    if args.json:
        emit_json(json_report(plan, requests, results, paths, diffs, identical))
    else:
        print_report(plan.schedules, results, paths, diffs)
    # the run did its job, diverged or not (the divergence is what it found); --check gates CI on it
    return 1 if args.check and not identical else 0


@dataclass(frozen=True)
class RunPlan:
    """What the command line asks for, checked, before any model loads."""
    cfg: object  # workloads.runner.RunConfig
    schedules: list
    policy: str
    spec_k: int
    demo_policy: bool  # the demo (no --model) on its own kernel policy (no --policy)
    sampling: dict  # the sampling defaults of prompt lines that set none


def plan_run(args) -> RunPlan:
    """Check the flags (the output directory once, here) and build the run config."""
    from ..engine.kernels.dispatch import KernelPolicy  # (lazy: loads MLX)
    from ..workloads.runner import RunConfig

    demo = args.model is None
    schedules = parse_schedules(args.schedules)
    check_output_dir(args.out, files=[f"{s}.h5" for s in schedules], inputs=[args.prompts] if args.prompts else (),
                     command="run")
    demo_policy = demo and args.policy is None
    policy = args.policy or (DEMO_POLICY if demo_policy else "native")
    KernelPolicy.parse(policy)
    spec_k = args.spec_k if args.spec_k is not None else (DEMO_SPEC_K if demo else 0)
    at_least_one("--top-k", args.top_k)
    sampling = sampling_defaults(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    if args.max_tokens is not None:
        at_least_one("--max-tokens", args.max_tokens)
    target_dir, draft_dir = default_model_dirs()
    cfg = RunConfig(model=args.model or target_dir, draft=args.draft or (draft_dir if spec_k else None),
                    dtype=args.dtype, policy=policy, spec_k=spec_k, token_budget=args.token_budget,
                    top_k=args.top_k, prefix_caching=args.prefix_cache, kv_hashes=not args.no_kv_hashes,
                    prefill=args.prefill, stop_at_eos=not (args.ignore_eos if args.ignore_eos is not None else demo),
                    tp=tp_degree(args))
    return RunPlan(cfg=cfg, schedules=schedules, policy=policy, spec_k=spec_k,
                   demo_policy=demo_policy, sampling=sampling)


def load_requests(args, encode, sampling) -> list:
    """--prompts, or the built-in set."""
    if args.prompts:
        return load_prompts(args.prompts, encode, max_tokens=args.max_tokens, sampling=sampling)
    return builtin_requests(encode, max_tokens=args.max_tokens, sampling=sampling)


def describe_setup(say, blas, blas_threads: int | None, plan: RunPlan) -> None:
    """The BLAS, the tensor-parallel group and the demo's kernel policy, on stderr."""
    core = blas.blas_core()
    say(f"BLAS: {blas.blas_in_use()}" + (f", core {core}, {blas_threads or blas.blas_threads()} threads"
                                          if core else ""))
    if plan.cfg.tp > 1:
        from ..parallel.group import current  # (lazy: loads MLX)

        t = current()
        say(f"tensor parallel: {t.size} ranks over {t.backend} ({t.launcher}); rank 0 writes the traces")
    if plan.demo_policy:
        say("demo: threshold:4 (rows <= 4 -> gemv, else split-K gemm) emulates a GPU's shape-dependent GEMM "
            "on a CPU whose own kernels are batch-invariant")


def diff_schedules(paths: dict, schedules: list) -> dict:
    """{schedule: TraceDiff} of each schedule after the first against the first."""
    from ..analysis.diff import diff_traces  # (lazy: loads numpy)
    from ..trace.reader import Trace  # (lazy: loads h5py)

    diffs = {}
    base = schedules[0]
    for s in schedules[1:]:
        with Trace.open(paths[base]) as a, Trace.open(paths[s]) as b:
            diffs[s] = diff_traces(a, b)
    return diffs


def json_report(plan: RunPlan, requests, results, paths, diffs, identical: bool) -> dict:
    schedules = plan.schedules
    return {
        "traces": paths,
        "identical": identical,
        "policy": plan.policy,
        "spec_k": plan.spec_k,
        "requests": [
            {"id": r.id, "tokens": {s: results[s].outputs[r.id].tokens for s in schedules},
             "text": {s: results[s].outputs[r.id].text for s in schedules},
             "acceptance_rate": {s: results[s].outputs[r.id].acceptance_rate for s in schedules}}
            for r in requests],
        "diff": {s: d.to_json() for s, d in diffs.items()},
    }


def print_report(schedules, results, paths, diffs) -> None:
    base = schedules[0]
    for s in schedules:
        r = results[s]
        rates = [o.acceptance_rate for o in r.outputs.values() if o.acceptance_rate is not None]
        acc = f", acceptance {sum(rates) / len(rates):.1%}" if rates else ""
        print(f"{s:<11} {len(r.outputs)} requests, {r.generated_tokens} tokens, {r.steps} steps "
              f"({r.target_steps} target), {r.seconds:.1f} s{acc} -> {paths[s]}")
    for s, d in diffs.items():
        if d.identical:
            print(f"{base} vs {s}: identical ({len(d.requests)} requests)")
            continue
        where = ", ".join(
            f"{x.id} at position {x.first_divergent_token.position} (generated #{x.first_divergent_token.generated_index})"
            if x.first_divergent_token else f"{x.id} ({x.status})" for x in d.diverged)
        print(f"{base} vs {s}: diverged: {where}")
        print(f"next: divergence bisect {paths[base]} {paths[s]} --confirm")


def check_blas_request(args, blas) -> int | None:
    """--blas-core / --blas-threads, once the BLAS has loaded (cli/reexec.py set the core
    before it did): the core OpenBLAS runs must be the one asked for. The thread count.
    blas: the module engine.kernels.blas (imported lazily by main: importing it loads the BLAS)."""
    if (args.blas_core or args.blas_threads) and blas.blas_threads() is None:
        raise PromptError(f"--blas-core / --blas-threads set OpenBLAS, and this run uses {blas.blas_in_use()}")
    if args.blas_core and (blas.blas_core() or "").lower() != args.blas_core.lower():
        raise PromptError(f"--blas-core {args.blas_core}: OpenBLAS runs core {blas.blas_core()} (a DYNAMIC_ARCH "
                          f"build takes OPENBLAS_CORETYPE; this one did not)")
    if args.blas_threads is not None:
        at_least_one("--blas-threads", args.blas_threads)
    return args.blas_threads
