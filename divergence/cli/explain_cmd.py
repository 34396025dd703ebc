"""`divergence explain LIVE.h5 ID [ID ...]`: why a `divergence serve` response came out as it
did. Re-runs the named requests serially (with the requests whose prefix-cache blocks they
read), then diffs, bisects and confirms them against the live trace: bisect --confirm's
report, for those requests only."""
from __future__ import annotations

import sys
import tempfile

from .common import emit_json
from .html_page import check_out, write_page
from .paths import check_output_dir, remember_outputs

HELP = ("explain live requests: re-run them serially, then diff, bisect and confirm them against the live trace "
        "(the id is the `id` a divergence serve response carried)")


def add_arguments(p) -> None:
    p.add_argument("live", metavar="LIVE.h5", help="a trace divergence serve wrote (a file, or the --trace-dir: "
                   "the request is looked for in the file's rotation siblings too)")
    p.add_argument("ids", metavar="ID", nargs="+", help="request ids, as the responses carried them")
    p.add_argument("--html", metavar="OUT.html", help="also write the report as one self-contained HTML page (an "
                   "existing HTML page there is replaced; any other file, a trace above all, is refused)")
    p.add_argument("--json", action="store_true", help="print a JSON report (bisect --json's keys)")
    p.add_argument("--bitwise", action="store_true", help="a request whose tokens match but whose logits differ "
                   "counts as diverged: it gets a root cause and a confirmation like any other (exit 1)")
    p.add_argument("--out", metavar="DIR", help="keep the serial re-run there (serial.h5; default: a temporary "
                   "directory, removed at the end; an existing serial.h5 is replaced only if it is explain's own earlier "
                   "output, unchanged since)")
    p.add_argument("--model", metavar="DIR", help="model directory, if it moved since the trace was recorded")
    p.add_argument("--draft", metavar="DIR", help="draft model directory, if it moved")


def main(args) -> int:
    # (lazy: loads numpy and h5py; the parser imports every command)
    from ..analysis.explain import analyze, check_explainable, locate
    from ..analysis.pipeline import AnalysisOptions, foreign
    from ..analysis.report import render_bisect
    from ..trace.reader import Trace

    found = locate(args.live, args.ids)
    html = check_out(args.html, inputs=(found.path,)) if args.html else None
    if args.out is not None:
        check_output_dir(args.out, files=["serial.h5"], inputs=[found.path], command="explain")
    if found.sibling:
        print(f"explain: {', '.join(found.ids)} found in {found.path}", file=sys.stderr)
    with Trace.open(found.path) as live:
        check_explainable(live, found.ids)
    with tempfile.TemporaryDirectory(prefix="divergence-explain-") as tmp:
        ref = _rerun(found, args.out or tmp, args)
        if args.out is not None:
            remember_outputs([ref], command="explain")  # its next run may replace it
        with Trace.open(ref) as a, Trace.open(found.path) as b:
            report = analyze(a, b, found.ids, AnalysisOptions(confirm=True, bitwise=args.bitwise,
                                                              model_dir=args.model, draft_dir=args.draft))
            if args.out is None:  # the re-run's file goes with the temporary directory
                report.diff.path_a = "a serial re-run (not kept: --out DIR keeps it)"
            if html is not None:
                print(write_page(report, a, b, html), file=sys.stderr)
            if args.json:
                emit_json(dict(report.to_json(), explain={"live": str(found.path), "requests": found.ids,
                                                          "rerun": str(ref) if args.out else None}))
            else:
                print(render_bisect(report, a.vocab, foreign=foreign(a, b)))
    if args.out is not None and not args.json:
        print(f"kept: {ref} (browse the pair: divergence browse {ref} {found.path})", file=sys.stderr)
    return 0 if report.identical else 1


def _rerun(found, out, args):
    """The serial re-run of the named requests (and their prefix-cache sources) -> its path."""
    from ..serve.rerun import rerun  # (lazy: loads MLX)
    from .progress import rerun_progress

    with rerun_progress(found.path, found.ids) as observers:
        path, result, _ = rerun(found.path, out, request_ids=found.ids, model_dir=args.model, draft_dir=args.draft,
                                observers=observers)
    sources = getattr(result, "prefix_sources", {})
    if sources:
        print("explain: also re-ran " + ", ".join(f"{s} (its prefix-cache blocks were read by {', '.join(r)})"
                                                  for s, r in sources.items()), file=sys.stderr)
    return path
