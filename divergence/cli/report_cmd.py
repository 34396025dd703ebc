"""`divergence report A.h5 B.h5 --html OUT.html`: the bisect report as one self-contained HTML page."""
from __future__ import annotations

from pathlib import Path

from ..errors import DivergenceInputError
from . import bisect_cmd
from .common import emit_json, open_pair

HELP = "write the bisect report of two traces as one self-contained HTML page (opens offline)"


def add_arguments(p) -> None:
    bisect_cmd.add_arguments(p, html_required=True)  # the same options as bisect (--confirm, --model, ...)


def check_out(path) -> Path:
    """The page's path, refused before any work when it can't be a file."""
    p = Path(path)
    if p.is_dir():
        raise DivergenceInputError(f"--html {p} is a directory; name the page's file, e.g. {p / 'report.html'}")
    if p.parent.exists() and not p.parent.is_dir():
        raise DivergenceInputError(f"--html {p}: {p.parent} is not a directory")
    return p


def write_page(report, a, b, path) -> str:
    """Write the page; returns the line to tell the user."""
    from ..analysis.html import write_html

    try:
        p = write_html(report, a, b, path)
    except OSError as e:
        raise DivergenceInputError(f"cannot write {path}: {e.strerror or e}") from None
    return f"html report: {p} ({p.stat().st_size / 1024:.0f} KiB)"


def main(args) -> int:
    out = check_out(args.html)
    a, b = open_pair(args.a, args.b)
    with a, b:
        report = bisect_cmd.build_report(args, a, b)
        line = write_page(report, a, b, out)
        if args.json:
            emit_json(dict(report.to_json(), html=str(out)))
        else:
            print(line)
    return 0
