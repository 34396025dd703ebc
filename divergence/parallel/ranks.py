"""Tensor parallelism for every subcommand: how many ranks a command needs, starting
them on this machine (launch.py), and running a command as one rank.

A command that needs N > 1 ranks (`run --tp N`, `probe --tp N`, `replay` of a TP
trace, `bisect --confirm` of a pair holding one) is started as N identical processes
of the same command line (SPMD): each rank runs the same engine on the same data, so
their collectives match; only rank 0 writes files and prints. Under mlx.launch the
processes already exist: each joins the launched group.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

from ..errors import TensorParallelError
from .divisible import ShardShape, check_degree
from .env import backend, in_launched_group, launched_size


def tp_degree(args) -> int:
    """Ranks the command needs: --tp where it has one (in a launched group without
    --tp: the group's size), the recorded degree of the trace(s) it replays."""
    cmd = args.command
    if cmd in ("run", "probe"):
        n = getattr(args, "tp", None)
        if n is None and in_launched_group():
            n = launched_size()
        n = 1 if n is None else n
        if n < 1:
            raise TensorParallelError(f"--tp must be >= 1, got {n}")
        return n
    if cmd == "replay":
        return _trace_degree(args.trace)[0]
    if cmd in ("bisect", "report"):
        if getattr(args, "confirm_cmd", None):
            return 1  # the user's own engine confirms: nothing of ours replays
        (da, kva), (db, kvb) = _trace_degree(args.a), _trace_degree(args.b)
        replays = args.confirm or not (kva and kvb)  # bisect without KV hashes replays too
        return max(da, db) if replays else 1
    return 1


def _trace_degree(path) -> tuple[int, bool]:
    """(TP degree, has KV hashes) of a trace; (1, True) when it cannot be read here:
    the command itself then reports the bad path (one line, exit 2)."""
    from ..trace.reader import Trace

    try:
        with Trace.open(path) as t:
            return t.tp_degree, t.has_kv_hashes
    except Exception:
        return 1, True


def check_model_dirs(args, n: int, defaults: tuple) -> None:
    """Refuse `--tp N` that does not divide the heads before starting any rank (the
    ranks check again, on the loaded weights). defaults: the (target, draft) dirs a
    command without --model runs."""
    target, draft = defaults
    dirs = [getattr(args, "model", None) or target]
    if getattr(args, "draft", None) or (getattr(args, "spec_k", None) or 0) > 0 or getattr(args, "model", None) is None:
        dirs.append(getattr(args, "draft", None) or draft)
    for d in dirs:
        try:
            cfg = json.loads((Path(d) / "config.json").read_text())
        except (OSError, ValueError):
            continue  # the ranks report a missing or bad model directory themselves
        shape = ShardShape.of_config(cfg) if isinstance(cfg, dict) else None
        if shape is not None:
            check_degree(shape, n, where=str(d))


def distribute(args, argv: list[str], default_models: tuple) -> int | None:
    """None: run the command here as usual. Otherwise the exit code of the command run
    as ranks: started here (N > 1, no group yet) or as this process's rank.
    default_models: the (target, draft) dirs a command without --model runs."""
    n = tp_degree(args)
    if in_launched_group():
        return _as_rank(args, n)
    if n <= 1:
        return None
    if args.command == "run":
        check_model_dirs(args, n, default_models)
    from .launch import launch

    try:
        backend()
    except ValueError as e:
        raise TensorParallelError(str(e)) from None
    started = time.time()
    return launch([sys.executable, "-m", "divergence", *argv], n, label=f"divergence {args.command}",
                  kept=lambda: _kept(args, started))


def _as_rank(args, n: int) -> int:
    from . import group as tpmod
    from .launch import CRASHED, PEER_LOST

    try:
        t = tpmod.init_from_env(expected=n if n > 1 else None)
    except RuntimeError as e:  # e.g. a port taken since the launcher chose it: it retries
        print(f"divergence-tp: cannot join the group: {e}", file=sys.stderr)
        return CRASHED
    t.keep_full = args.command in ("replay", "bisect", "report")  # their replays may force STEP:unsharded
    scratch = None
    if not t.writes:
        sys.stdout = open(os.devnull, "w")  # rank 0 alone reports
        if getattr(args, "html", None):  # and writes pages: the others' go to a temp dir, removed at the end
            scratch = tempfile.TemporaryDirectory(prefix="divergence-tp-rank-")
            args.html = os.path.join(scratch.name, "report.html")
    try:
        return int(args._run(args) or 0)
    except RuntimeError as e:
        if not _peer_lost(e):
            traceback.print_exc()
            return CRASHED
        print(f"divergence-tp: rank {t.rank}: {e}", file=sys.stderr)
        return PEER_LOST
    finally:
        if scratch is not None:
            scratch.cleanup()


def _peer_lost(e: Exception) -> bool:
    text = str(e).lower()
    return any(w in text for w in ("[ring]", "[nccl]", "peer", "connection"))


def _kept(args, started: float) -> str:
    """The partial traces a failed `run` left (a trace is renamed only once complete)."""
    out = getattr(args, "out", None)
    if args.command != "run" or not out:
        return ""
    from ..trace.reader import Trace

    kept = []
    for p in sorted(Path(out).glob("*.h5.partial")):
        if p.stat().st_mtime < started - 1:
            continue
        try:
            with Trace.open(p) as tr:
                kept.append(f"{p} ({tr.num_steps} steps)")
        except Exception:  # noqa: BLE001  (a file killed before its first flush)
            kept.append(f"{p} (unreadable)")
    return f"steps already written are kept in {', '.join(kept)}" if kept else ""
