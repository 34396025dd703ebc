"""`divergence import DIR --out T.h5`: another engine's JSON Lines records -> a trace."""
from __future__ import annotations

from pathlib import Path

from .common import emit_json
from .paths import check_output_file, remember_outputs

HELP = ("write a trace from another engine's JSON Lines records (docs/recording.md): "
        "one file per record kind, or lines with a 'kind' field")


def add_arguments(p) -> None:
    p.add_argument("src", metavar="DIR", help="directory of .jsonl files (or one .jsonl file)")
    p.add_argument("--out", metavar="T.h5", required=True, help="the trace to write: one file, not a directory "
                   "as run's --out (an existing file there is replaced only if it is import's own earlier output, "
                   "unchanged since, and only when every record is good)")
    p.add_argument("--json", action="store_true", help="print a JSON summary")


def main(args) -> int:
    from ..record.jsonl import import_records  # (lazy: loads numpy and h5py; the parser imports every command)

    check_output_file(args.out, flag="--out", inputs=_inputs(args.src), command="import")
    counts = import_records(args.src, args.out)
    remember_outputs([args.out], command="import")
    if args.json:
        emit_json({"trace": args.out, **counts})
    else:
        print(f"{args.out}: {counts['requests']} requests, {counts['steps']} steps, {counts['tokens']} tokens "
              f"(from {args.src})")
    return 0


def _inputs(src) -> list:
    """The paths `import` reads: SRC, and a directory's .jsonl files."""
    p = Path(src)
    try:
        return [p, *sorted(p.glob("*.jsonl"))] if p.is_dir() else [p]
    except OSError:
        return [p]
