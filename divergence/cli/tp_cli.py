"""Tensor parallelism for every subcommand: how many ranks a command needs, starting
them on this machine (divergence/tp_launch.py), and running a command as one rank.

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
import time
import traceback
from pathlib import Path

from ..errors import TensorParallelError
from ..tp_launch import in_launched_group, is_writer  # noqa: F401  (is_writer: used by run_cmd)

def tp_degree(args) -> int:
    """Ranks the command needs: --tp where it has one (in a launched group without
    --tp: the group's size), the recorded degree of the trace(s) it replays."""
    cmd = args.command
    if cmd in ("run", "probe"):
        n = getattr(args, "tp", None)
        if n is None and in_launched_group():
            n = _launched_size()
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


def _launched_size() -> int | None:
    for k in ("DIVERGENCE_TP_SIZE", "MLX_WORLD_SIZE"):
        if k in os.environ:
            return int(os.environ[k])
    try:
        with open(os.environ["MLX_HOSTFILE"]) as f:
            return len(json.load(f))
    except (KeyError, OSError, ValueError):
        return None


def _trace_degree(path) -> tuple[int, bool]:
    """(TP degree, has KV hashes) of a trace; (1, True) when it cannot be read here:
    the command itself then reports the bad path (one line, exit 2)."""
    from ..trace.reader import Trace

    try:
        with Trace.open(path) as t:
            return t.tp_degree, t.has_kv_hashes
    except Exception:
        return 1, True


def check_model_dirs(args, n: int) -> None:
    """Refuse `--tp N` that does not divide the heads before starting any rank (the
    ranks check again, on the loaded weights)."""
    from .common import default_model_dirs

    target, draft = default_model_dirs()
    dirs = [getattr(args, "model", None) or target]
    if getattr(args, "draft", None) or (getattr(args, "spec_k", None) or 0) > 0 or getattr(args, "model", None) is None:
        dirs.append(getattr(args, "draft", None) or draft)
    for d in dirs:
        try:
            cfg = json.loads((Path(d) / "config.json").read_text())
        except (OSError, ValueError):
            continue  # the ranks report a missing or bad model directory themselves
        for key, what in (("num_attention_heads", "attention heads"), ("num_key_value_heads", "KV heads"),
                          ("intermediate_size", "MLP features")):
            v = cfg.get(key, cfg.get("num_attention_heads") if key == "num_key_value_heads" else None)
            if isinstance(v, int) and v % n:
                raise TensorParallelError(f"--tp {n} does not divide the {v} {what} of {d}")


def distribute(args, argv: list[str]) -> int | None:
    """None: run the command here as usual. Otherwise the exit code of the command run
    as ranks: started here (N > 1, no group yet) or as this process's rank."""
    n = tp_degree(args)
    if in_launched_group():
        return _as_rank(args, n)
    if n <= 1:
        return None
    if args.command == "run":
        check_model_dirs(args, n)
    from ..tp_launch import launch

    from ..tp_launch import backend

    try:
        backend()
    except ValueError as e:
        raise TensorParallelError(str(e)) from None
    started = time.time()
    return launch([sys.executable, "-m", "divergence", *argv], n, label=f"divergence {args.command}",
                  kept=lambda: _kept(args, started))


def _as_rank(args, n: int) -> int:
    from ..engine import tp as tpmod
    from ..tp_launch import CRASHED, PEER_LOST

    try:
        t = tpmod.init_from_env(expected=n if n > 1 else None)
    except RuntimeError as e:  # e.g. a port taken since the launcher chose it: it retries
        print(f"divergence-tp: cannot join the group: {e}", file=sys.stderr)
        return CRASHED
    t.keep_full = args.command in ("replay", "bisect")  # their replays may force STEP:unsharded
    if not t.writes:
        sys.stdout = open(os.devnull, "w")  # rank 0 alone reports
        if getattr(args, "html", None):  # and writes pages: the others' go to their own temp dir
            import tempfile

            args.html = os.path.join(tempfile.mkdtemp(prefix="divergence-tp-rank-"), "report.html")
    try:
        return int(args._run(args) or 0)
    except RuntimeError as e:
        if not _peer_lost(e):
            traceback.print_exc()
            return CRASHED
        print(f"divergence-tp: rank {t.rank}: {e}", file=sys.stderr)
        return PEER_LOST


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
