"""`divergence` command line: one module per subcommand, one error policy for all.

Exit codes: 0 success, 1 a compared pair diverged (diff/bisect) or a check
failed, 2 bad input (one line on stderr, no traceback).
"""
from __future__ import annotations

import argparse
import os
import sys
import textwrap
from importlib import import_module

from .. import __version__
from ..errors import DivergenceInputError
from ..parallel.ranks import distribute
from .common import default_model_dirs
from .reexec import run_under_recorded_environment, run_under_requested_core

SUBCOMMANDS = ("run", "diff", "bisect", "report", "replay", "browse", "sweep", "probe", "import", "serve", "rerun",
               "explain", "redact")


BAD_INPUT = "bad input (one line on stderr, nothing written)"
# Each command's exit codes, as its --help shows them (tests/cli/test_exit_codes.py checks them).
EXIT_CODES = {
    "run": {0: "the traces were recorded (diverged or not; with --check: every schedule gave the same tokens)",
            1: "with --check: the schedules diverged (their traces are written)", 2: BAD_INPUT},
    "diff": {0: "identical", 1: "diverged (with --bitwise: logits included)", 2: BAD_INPUT},
    "bisect": {0: "identical", 1: "diverged (the report says why)", 2: BAD_INPUT},
    "report": {0: "identical", 1: "diverged (the page is written either way)", 2: BAD_INPUT},
    "replay": {0: "faithful, or --force given (a forced replay is meant to differ); with --against: the "
                  "forced replay matches A where the original diverged",
               1: "an unforced replay differs from its trace; with --against: a diverged request still "
                  "differs from A at or before where it diverged",
               2: BAD_INPUT},
    "browse": {0: "quit", 2: BAD_INPUT},
    "sweep": {0: "the sweep ran (it measures: any number of unique completions)", 2: BAD_INPUT},
    "probe": {0: "the map was measured (or read from the cache)", 2: BAD_INPUT},
    "import": {0: "the trace was written", 2: BAD_INPUT},
    "serve": {0: "stopped (SIGTERM or Ctrl-C): the requests taken were finished and the trace closed",
              2: BAD_INPUT},
    "rerun": {0: "the reference trace was written", 2: BAD_INPUT},
    "explain": {0: "the requests are identical to their serial re-run",
                1: "a request diverged from its serial re-run (the report says why, and whether replay confirmed it)",
                2: BAD_INPUT},
    "redact": {0: "the redacted copies were written", 2: BAD_INPUT},
}


def exit_codes_epilog(command: str) -> str:
    return "exit codes:\n" + "\n".join(textwrap.fill(v, 78, initial_indent=f"  {k}  ", subsequent_indent="     ")
                                         for k, v in sorted(EXIT_CODES[command].items()))


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the epilog's lines, and shows every option's default where its help doesn't say it."""

    def _get_help_string(self, action):
        text = action.help or ""
        d = action.default
        if (action.option_strings and "default" not in text and d not in (None, False, [], argparse.SUPPRESS)
                and action.nargs != 0):
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one clear line, exit 2 (argparse prints usage too)
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="divergence", description="Find out why an LLM engine's output changes when "
                     "requests are batched: run, diff, bisect and replay traces.",
                     epilog="exit codes: 0 success, 1 a compared pair diverged, 2 bad input "
                            "(each command's --help says when)", formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"divergence {__version__}")
    parser.add_argument("--reference-blas", action="store_true",
                        help="keep MLX's bundled reference BLAS (don't load OpenBLAS); same as DIVERGENCE_BLAS=reference")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in SUBCOMMANDS:
        mod = import_module(f".{name}_cmd", __package__)
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP, epilog=exit_codes_epilog(name),
                           formatter_class=_Formatter)
        mod.add_arguments(p)
        # the global option after the subcommand too (`divergence run --reference-blas`); main()
        # reads it from argv before anything loads a BLAS
        p.add_argument("--reference-blas", action="store_true", dest="reference_blas_here", default=argparse.SUPPRESS,
                       help="keep MLX's bundled reference BLAS (as before the command)")
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
        code = run_under_requested_core(args, argv)  # run --blas-core
        if code is not None:
            return code
        code = run_under_recorded_environment(args, argv)  # traces of another OpenBLAS core
        if code is not None:
            return code
        # --tp: start the ranks here, or run as one of them
        code = distribute(args, argv, default_model_dirs())
        if code is not None:
            return code
        from .progress import replay_progress  # (lazy: loads numpy; the parser imports every command)

        with replay_progress():  # on a terminal: 'replaying step 120/433' (replay, bisect --confirm, report)
            return int(args._run(args) or 0)
    except DivergenceInputError as e:
        print(f"divergence {args.command}: error: {' '.join(str(e).split())}", file=sys.stderr)  # one line, always
        return 2
    except KeyboardInterrupt:
        print(f"divergence {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `divergence bisect ... --json | head`: the reader left, not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python flushes stdout at exit: don't raise again there
        return 1


def console() -> None:
    """The `divergence` command (console script and `python -m divergence`): main(), then
    leave without the interpreter's teardown (leave.py says why)."""
    from .leave import leave

    leave(main())


if __name__ == "__main__":  # pragma: no cover
    console()
