"""`divergence bisect A.h5 B.h5 [--confirm]`: from a divergent token back to the step that caused it."""
from __future__ import annotations

import sys

from ..errors import DivergenceInputError
from .common import emit_json, open_pair

HELP = "walk back from each divergent token to the batch step that caused it; --confirm proves it by replay"


def add_arguments(p, *, html_required: bool = False) -> None:
    p.add_argument("a", metavar="A.h5")
    p.add_argument("b", metavar="B.h5")
    p.add_argument("--confirm", action="store_true", help="replay B with the root-cause step forced to A's kernel")
    p.add_argument("--confirm-cmd", metavar="CMD", help="confirm through your own engine: a shell command "
                   "that re-runs B with the cause step changed and writes a trace to {out}; placeholders "
                   "{trace} {step} {requests} {request} {force} {out} (see docs/recording.md)")
    p.add_argument("--model", metavar="DIR", help="model directory, if it moved since the traces were recorded")
    p.add_argument("--draft", metavar="DIR", help="draft model directory, if it moved")
    p.add_argument("--ops", action="store_true", default=None,
                   help="replay both root-cause steps recording every op's output rows and name the first op "
                        "whose bits differ (on by default with --confirm)")
    p.add_argument("--no-ops", dest="ops", action="store_false", default=None,
                   help="with --confirm, skip the op-by-op comparison")
    p.add_argument("--bitwise", action="store_true",
                   help="a request whose tokens match but whose logits differ counts as diverged: it gets a root "
                        "cause (and with --confirm a confirmation) like any other, and the exit code is 1")
    p.add_argument("--html", metavar="OUT.html", required=html_required,
                   help="where to write the page" if html_required else
                   "also write the report as one self-contained HTML page")
    p.add_argument("--json", action="store_true", help="print a JSON report")


def main(args) -> int:
    from ..analysis.report import render_bisect
    from .html_page import check_out, write_page

    html = check_out(args.html, inputs=(args.a, args.b)) if getattr(args, "html", None) else None
    a, b = open_pair(args.a, args.b)
    with a, b:
        report = build_report(args, a, b)
        if html is not None:
            print(write_page(report, a, b, html), file=sys.stderr)
        if args.json:
            emit_json(report.to_json())
        else:
            print(render_bisect(report, a.vocab))
    return 0 if report.identical else 1


def build_report(args, a, b):
    """The BisectReport of two open traces, as the options ask (report_cmd uses it too)."""
    from ..analysis.bisect import bisect_traces

    replayer = bisector = None
    from ..analysis.diff import trace_label

    labels = (trace_label(a), trace_label(b))
    confirm_cmd = getattr(args, "confirm_cmd", None)
    if confirm_cmd:  # the user's engine confirms (traces of other engines)
        from ..analysis.confirm_cmd import make_command_confirmer

        if args.confirm:
            raise DivergenceInputError("--confirm replays with divergence's engine, --confirm-cmd with yours: "
                                       "give one")
        replayer = make_command_confirmer(a, b, confirm_cmd, *labels)
    asked = getattr(args, "ops", None)
    ops = bool(args.confirm) if asked is None else asked
    if confirm_cmd or _foreign(a, b) or max(a.tp_degree, b.tp_degree) > 1:
        if asked:  # nothing of ours to replay op by op (another engine's traces, sharded runs)
            why = ("they are another engine's" if confirm_cmd or _foreign(a, b) else
                   f"a TP={max(a.tp_degree, b.tp_degree)} run is sharded")
            print(f"note: --ops replays one device op by op with divergence's engine, and {why}: the first op "
                  f"that differed is not looked for", file=sys.stderr)
        ops = False
    op_finder = None
    if confirm_cmd:
        pass
    elif args.confirm or ops or not (a.has_kv_hashes and b.has_kv_hashes) and not _foreign(a, b):
        from ..analysis.replay import Replayer, check_replayable, make_confirmer, make_op_finder, make_replay_bisector

        if args.confirm or ops:
            check_replayable(a)
            check_replayable(b)
        engine_replayer = Replayer(model_dir=args.model, draft_dir=args.draft)
        replayer = make_confirmer(a, b, engine_replayer, *labels)
        if a.tp_degree != b.tp_degree:  # TP=1 vs TP=N: proven by replaying the TP side unsharded
            from ..analysis.tp import make_tp_confirmer

            replayer = make_tp_confirmer(a, b, engine_replayer, *labels)
        bisector = make_replay_bisector(a, b, engine_replayer, *labels)
        if ops:
            op_finder = make_op_finder(a, b, engine_replayer, *labels)
    return bisect_traces(a, b, confirm=args.confirm or bool(confirm_cmd), replayer=replayer,
                         replay_bisector=bisector, bitwise=args.bitwise, op_finder=op_finder)


def _foreign(a, b) -> bool:
    """Recorded by another engine: replay can't bisect them (without KV hashes, no lead)."""
    return any(t.meta.get("settings", {}).get("engine") for t in (a, b))
