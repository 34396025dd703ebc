"""`divergence report A.h5 B.h5 --html OUT.html`: the bisect report as one self-contained HTML page."""
from __future__ import annotations

from . import bisect_cmd
from .common import emit_json, open_pair
from .html_page import check_out, write_page

HELP = "write the bisect report of two traces as one self-contained HTML page (opens offline)"


def add_arguments(p) -> None:
    bisect_cmd.add_arguments(p, html_required=True)  # the same options as bisect (--confirm, --model, ...)


def main(args) -> int:
    out = check_out(args.html, inputs=(args.a, args.b))
    a, b = open_pair(args.a, args.b)
    with a, b:
        bisect_cmd.select_requests(args, a, b)
        report = bisect_cmd.build_report(args, a, b)
        line = write_page(report, a, b, out)
        if args.json:
            emit_json(dict(report.to_json(), html=str(out)))
        else:
            print(line)
    return 0 if report.identical else 1  # as bisect: the page is written either way
