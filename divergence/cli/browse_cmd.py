"""`divergence browse A.h5 [B.h5]`: a terminal UI over one trace or a diverged pair."""
from __future__ import annotations

HELP = "explore one trace, or a diverged pair, in a terminal UI (press ? inside for the keys)"


def add_arguments(p) -> None:
    p.add_argument("a", metavar="A.h5")
    p.add_argument("b", metavar="B.h5", nargs="?")


def main(args) -> int:
    from ..tui.app import run_browser  # (lazy: loads textual)

    return run_browser(args.a, args.b)
