"""`divergence` command line: one module per subcommand, one error policy for all.

Exit codes: 0 success, 1 a compared pair diverged (diff/bisect) or a check
failed, 2 bad input (one line on stderr, no traceback).
"""
from __future__ import annotations

import argparse
import os
import sys

from ..errors import DivergenceInputError

SUBCOMMANDS = ("run", "diff", "bisect", "report", "replay", "browse", "sweep", "probe", "import")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one clear line, exit 2 (argparse prints usage too)
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    from importlib import import_module

    parser = _Parser(prog="divergence", description="Find out why an LLM engine's output changes when "
                     "requests are batched: run, diff, bisect and replay traces.")
    parser.add_argument("--reference-blas", action="store_true",
                        help="keep MLX's bundled reference BLAS (don't load OpenBLAS); same as DIVERGENCE_BLAS=reference")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in SUBCOMMANDS:
        mod = import_module(f".{name}_cmd", __package__)
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.main)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--reference-blas" in argv:
        os.environ["DIVERGENCE_BLAS"] = "reference"  # before anything imports mlx
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # usage errors (2) and --help (0)
        return int(e.code or 0)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        from .tp_cli import distribute

        from .reexec import run_under_recorded_environment

        code = run_under_recorded_environment(args, argv)  # traces of another OpenBLAS core
        if code is not None:
            return code
        code = distribute(args, argv)  # --tp: start the ranks here, or run as one of them
        if code is not None:
            return code
        return int(args._run(args) or 0)
    except DivergenceInputError as e:
        print(f"divergence {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"divergence {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `divergence bisect ... --json | head`: the reader left, not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python flushes stdout at exit: don't raise again there
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
