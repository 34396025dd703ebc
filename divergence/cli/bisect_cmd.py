"""`divergence bisect A.h5 B.h5 [--confirm]`: from a divergent token back to the step that caused it."""
from __future__ import annotations

import sys

from .common import emit_json, open_pair
from .html_page import check_out, write_page

HELP = "walk back from each divergent token to the batch step that caused it; --confirm proves it by replay"


def add_arguments(p, *, html_required: bool = False) -> None:
    p.add_argument("a", metavar="A.h5")
    p.add_argument("b", metavar="B.h5")
    p.add_argument("--confirm", action="store_true", help="replay B with the root-cause step forced to A's kernel")
    p.add_argument("--confirm-cmd", metavar="CMD", help="confirm through your own engine: a shell command "
                   "that re-runs B with the cause step changed and writes a trace to {out}; placeholders "
                   "{trace} {step} {requests} {request} {force} {out} (see docs/recording.md)")
    p.add_argument("--keep", action="store_true", help="keep the re-runs' traces (--confirm-cmd), named in the "
                   "confirmation; by default their temporary directory is removed when bisect ends")
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
                   help=("where to write the page" if html_required else
                         "also write the report as one self-contained HTML page")
                   + " (an existing HTML page there is replaced; any other file, a trace above all, is refused)")
    add_requests_argument(p)
    p.add_argument("--json", action="store_true", help="print a JSON report")


def add_requests_argument(p) -> None:
    p.add_argument("--requests", metavar="ID,...", help="compare only these requests (read only their rows of "
                   "the traces: a multi-gigabyte live trace stays cheap)")


def select_requests(args, *traces) -> None:
    """--requests ID,...: the requests the analysis compares, chosen on each open trace."""
    spec = getattr(args, "requests", None)
    if spec is None:
        return
    ids = list(dict.fromkeys(i.strip() for i in spec.split(",") if i.strip()))
    for t in traces:
        t.select(ids)


def main(args) -> int:
    from ..analysis.report import render_bisect  # (lazy: loads numpy and h5py; the parser imports every command)

    html = check_out(args.html, inputs=(args.a, args.b)) if getattr(args, "html", None) else None
    a, b = open_pair(args.a, args.b)
    with a, b:
        select_requests(args, a, b)
        report = build_report(args, a, b)
        if html is not None:
            print(write_page(report, a, b, html), file=sys.stderr)
        if args.json:
            emit_json(report.to_json())
        else:
            from ..analysis.pipeline import foreign  # (lazy: loads numpy and h5py; the parser imports every command)

            print(render_bisect(report, a.vocab, foreign=foreign(a, b)))
    return 0 if report.identical else 1


def build_report(args, a, b):
    """The BisectReport of two open traces, as the options ask (report_cmd uses it too)."""
    # (lazy: loads numpy and h5py; the parser imports every command)
    from ..analysis.pipeline import AnalysisOptions, analyze_pair

    return analyze_pair(a, b, AnalysisOptions.from_args(args))
