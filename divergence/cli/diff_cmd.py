"""`divergence diff A.h5 B.h5`: the first divergent token and first numeric difference per request."""
from __future__ import annotations

from .bisect_cmd import add_requests_argument, select_requests
from .common import emit_json, open_pair

HELP = "compare two traces: first divergent token and first numeric difference per request"


def add_arguments(p) -> None:
    p.add_argument("a", metavar="A.h5")
    p.add_argument("b", metavar="B.h5")
    p.add_argument("--bitwise", action="store_true",
                   help="a request whose tokens match but whose logits differ counts as diverged (exit 1)")
    add_requests_argument(p)
    p.add_argument("--json", action="store_true", help="print a JSON report")


def main(args) -> int:
    from ..analysis.diff import diff_traces  # (lazy: loads numpy and h5py; the parser imports every command)
    from ..analysis.report import render_diff  # (lazy: loads numpy and h5py; the parser imports every command)

    a, b = open_pair(args.a, args.b)
    with a, b:
        select_requests(args, a, b)
        d = diff_traces(a, b, bitwise=args.bitwise)
        if args.json:
            emit_json(d.to_json())
        else:
            print(render_diff(d, a.vocab))
    return 0 if d.identical else 1
