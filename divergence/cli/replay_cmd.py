"""`divergence replay TRACE.h5`: re-execute the recorded schedule exactly and report fidelity."""
from __future__ import annotations

import argparse

from ..core.names import ATTENTION, ATTENTION_KERNELS, BATCH_INVARIANT, FORCIBLE_OPS, GEMM, GEMV, NATIVE
from ..core.policy import SOLO_NAME, UNSHARDED_NAME
from ..errors import DivergenceInputError
from .common import emit_json, open_pair
from .paths import check_output_file, remember_outputs


HELP = "re-execute a trace's exact schedule (optionally forcing kernels at steps) and report fidelity"


def add_arguments(p) -> None:
    p.add_argument("trace", metavar="TRACE.h5")
    p.add_argument("--force", action="append", default=[], metavar="STEP:KERNEL", help=_force_help())
    p.add_argument("--out", metavar="FILE.h5", help="the replayed trace: one file (run's --out is a directory) "
                   "(default: a temporary file, removed when replay ends unless --keep); an existing file there is "
                   "replaced only if it is replay's own earlier output, unchanged since: never another trace")
    p.add_argument("--keep", action="store_true", help="without --out, keep the temporary replayed trace")
    p.add_argument("--against", metavar="A.h5", help="the other trace of the pair TRACE diverged from: say what "
                   "the (forced) replay proved, request by request (and exit 1 where it proved nothing)")
    p.add_argument("--model", metavar="DIR", help="model directory, if it moved since the trace was recorded")
    p.add_argument("--draft", metavar="DIR", help="draft model directory, if it moved")
    p.add_argument("--json", action="store_true", help="print a JSON report")
    p.add_argument("--environment-of", metavar="OTHER.h5",
                   help="replay under the BLAS environment (library, OpenBLAS core, threads) OTHER.h5 was recorded "
                        "in, not TRACE.h5's own: TRACE's run as if made where OTHER's was (an environment cause's proof)")
    # for a parent process that needs one step's op rows under this trace's environment
    p.add_argument("--tap", metavar="STEP:REQUEST", help=argparse.SUPPRESS)
    p.add_argument("--tap-out", metavar="FILE", help=argparse.SUPPRESS)


def _force_help() -> str:
    """--force's help, its names from the core tables (core/names.py, core/policy.py)."""
    linear = [o for o in FORCIBLE_OPS if o != ATTENTION]
    return (f"run STEP with KERNEL: {GEMV} (every linear op row by row), {GEMM}, {GEMM}:S (split-K S), {NATIVE}, "
            f"{BATCH_INVARIANT}, threshold:N; or one op with STEP:OP=KERNEL, OP one of {', '.join(linear)} "
            f"(those kernels) or {ATTENTION} ({' | '.join(ATTENTION_KERNELS)}; e.g. 8:{ATTENTION}="
            f"{ATTENTION_KERNELS[0]}); STEP:{SOLO_NAME} = each request of the step alone, every op included "
            f"(proves native causes); STEP:{UNSHARDED_NAME} (or STEP:OP={UNSHARDED_NAME}) = a tensor-parallel "
            f"trace's sharded ops on the full weights, no all-reduce; repeatable")


def main(args) -> int:
    from ..analysis.replayer import replay  # (lazy: loads the BLAS)

    if args.out:  # before any work: not an input, not a directory, not a file replay did not write, writable
        check_output_file(args.out, flag="--out", inputs=(args.trace, args.against, args.environment_of),
                          command="replay")
    if getattr(args, "against", None):  # before any work too: a pair that diff would compare
        from ..analysis.diff import check_comparable  # (lazy: loads numpy and h5py; the parser imports every command)

        a, b = open_pair(args.against, args.trace)
        with a, b:
            check_comparable(a, b)
    if args.tap:
        return _tap(args)
    r = replay(args.trace, force=args.force, out=args.out, model_dir=args.model, draft_dir=args.draft,
               environment_of=args.environment_of, keep=getattr(args, "keep", False))
    if args.out:
        remember_outputs([args.out], command="replay")
    changed, against = _compare(args, r)
    code = 0 if (r.faithful or r.forced) else 1
    if against is not None and not against["proved"]:
        code = 1
    if args.json:  # replay's keys, and (added) what the forcing changed and proved
        emit_json(dict(r.to_json(), **({"changed_from_original": changed} if changed is not None else {}),
                       **({"against": against} if against is not None else {})))
        return code
    forced = ", ".join(f"step {k} -> {v}" for k, v in r.forced.items()) or "none"
    print(f"replayed {r.source} -> {r.out} (forced: {forced})")
    print(f"  {r.seconds:.2f} s (original steps took {r.original_seconds:.2f} s)")
    if r.faithful:
        what = ["tokens", "logits"] + (["KV hashes"] if r.kv_equal else []) + (["sampler draws"] if r.draws_equal else [])
        print(f"  faithful: {', '.join(what[:-1])} and {what[-1]} are bitwise equal")
    elif r.forced and changed is not None:  # meant to differ: say how, request by request
        print("  changed from the original (a forced replay is meant to differ; not a fidelity check):")
        for line in _changed_lines(changed):
            print(f"    {line}")
    else:
        draws = "" if r.draws_equal is None else f", draws equal {r.draws_equal}"
        print(f"  differs: tokens equal {r.tokens_equal}, logits equal {r.logits_equal}, KV equal {r.kv_equal}{draws}")
        if r.first_difference:
            print(f"  first difference: request {r.first_difference['request']} at position "
                  f"{r.first_difference['position']}")
        if r.kv_first_difference and r.kv_first_difference.get("reason"):
            print(f"  first K/V difference: {r.kv_first_difference['reason']}")
    if against is not None:
        print(f"  against {against['trace']} ({against['label']}):")
        for x in against["requests"]:
            print(f"    {x['line']}")
        print(f"  {'proved' if against['proved'] else 'not proved'}: {against['summary']}")
    return code


def _pos(x) -> int | None:
    return x.first_divergent_token.position if x.first_divergent_token else None


def _changed_lines(changed: dict) -> list[str]:
    lines = []
    for x in changed["requests"]:
        tok, num = x.get("first_divergent_token"), x.get("first_numeric_divergence")
        if tok:
            lines.append(f"{x['id']}  tokens from position {tok['position']}")
        elif num:
            lines.append(f"{x['id']}  tokens unchanged; logits from position {num['position']}")
        elif x["status"] == "identical":
            lines.append(f"{x['id']}  unchanged, bit for bit")
        else:
            lines.append(f"{x['id']}  {x['status']}")
    return lines


def _compare(args, r):
    """(what the replay changed against its original, what it proved against --against A), as
    JSON-ready dicts; (None, None) where the replayed trace was not written here."""
    if not r.out:
        return None, None
    # (lazy: loads numpy and h5py; the parser imports every command)
    from ..analysis.diff import diff_traces, trace_label
    from ..trace.reader import Trace  # (lazy: loads numpy and h5py; the parser imports every command)

    with Trace.open(args.trace) as orig, Trace.open(r.out) as new:
        changed = diff_traces(orig, new, bitwise=True).to_json() if r.forced else None
        if not getattr(args, "against", None):
            return changed, None
        with Trace.open(args.against) as a:
            before, after = diff_traces(a, orig), diff_traces(a, new)
            label_a, label_b = trace_label(a), trace_label(orig)
    rows, proved = [], True
    for x, y in zip(before.requests, after.requests):
        p0, p1 = _pos(x), _pos(y)
        if p0 is None and p1 is None:
            if x.status == "identical":
                continue
            line = f"{y.id}  {y.status}"
        elif p0 is None:
            proved = False
            line = f"{y.id}  matched {label_a} before; now diverges at position {p1}"
        elif p1 is None:
            line = (f"{y.id}  now matches {label_a} in every token (the original {label_b} diverged at position "
                    f"{p0})")
        elif p1 > p0:
            line = (f"{y.id}  now matches {label_a} up to position {p0}, where the original diverged"
                    + (f", and on to {p1 - 1}" if p1 - 1 > p0 else "")
                    + f"; after it, it diverges at position {p1}: a later cause (divergence bisect "
                      f"{args.against} {r.out})")
        else:
            proved = False
            line = (f"{y.id}  still diverges from {label_a}, at position {p1} (the original at {p0}): "
                    f"this forcing does not remove the cause")
        rows.append({"id": y.id, "original_position": p0, "position": p1, "line": line})
    was = [x.id for x in before.requests if _pos(x) is not None]
    summary = (f"every request that diverged ({', '.join(was)}) now matches {label_a} past where it diverged"
               if proved and was else "nothing diverged from A to begin with" if proved else
               "some request diverges from A where it did, or earlier")
    return changed, {"trace": str(args.against), "label": label_a, "proved": proved, "summary": summary,
                     "requests": rows}


def _tap(args) -> int:
    """--tap STEP:REQUEST --tap-out FILE: one step's op output rows for one request, recorded
    by a replay up to that step (analysis.environment_confirm reads them)."""
    # (lazy: loads numpy and h5py; the parser imports every command)
    from ..analysis.environment_confirm import save_tap
    from ..analysis.replayer import Replayer  # (lazy: loads the BLAS)
    from ..trace.reader import Trace  # (lazy: loads numpy and h5py; the parser imports every command)

    step, _, rid = args.tap.partition(":")
    if not step.isdigit() or not rid or not args.tap_out:
        raise DivergenceInputError("--tap STEP:REQUEST needs --tap-out FILE")
    with Trace.open(args.trace) as t:
        rows = Replayer(model_dir=args.model, draft_dir=args.draft).tap(t, int(step), rid)
    save_tap(rows, args.tap_out)
    return 0
