"""`divergence probe`: which row counts give the same bits as M=1, per op shape."""
from __future__ import annotations

from pathlib import Path

from ..errors import DivergenceInputError
from .common import add_model_args, default_model_dirs, emit_json

HELP = "map a backend's batch-invariance: row-count classes of every linear-op shape and of SDPA"


def add_arguments(p) -> None:
    add_model_args(p, draft=False)
    p.add_argument("--rows", default="1..128", help="row counts: A..B or a comma list (default 1..128)")
    p.add_argument("--kv-lens", default="64,256,1024",
                   help="KV lengths to probe SDPA at (query lengths from --rows up to each; default 64,256,1024)")
    p.add_argument("--no-cache", action="store_true", help="measure again instead of using the cached map")
    p.add_argument("--tp", type=int, metavar="N", help="instead: does the all-reduce of N tensor-parallel ranks "
                   "depend on the message size? (rows of the model's hidden width; starts N ranks)")
    p.add_argument("--json", action="store_true", help="print a JSON report")


def main(args) -> int:
    from ..engine.model.loading import load_model  # (lazy: loads MLX)
    from ..workloads.probe import parse_rows, probe_model  # (lazy: loads MLX)

    rows = parse_rows(_no_empty_items(args.rows, "--rows"))
    if args.tp is not None and args.tp > 1:
        return _probe_tp(args, rows)
    kv_lens = parse_rows(_no_empty_items(args.kv_lens, "--kv-lens"), "--kv-lens")
    target_dir, _ = default_model_dirs()
    loaded = load_model(args.model or target_dir, dtype=args.dtype)
    result = probe_model(loaded, rows, use_cache=not args.no_cache, kv_lens=kv_lens)
    if args.json:
        emit_json(result)
        return 0
    env = result["environment"]
    blas = f", BLAS: {env['blas']}" if env.get("backend") == "cpu" else ""  # the GPU's matmuls don't use it
    print(f"{result['model']}  ({env['device']}, MLX {env['mlx']}{blas})")
    w = max(len(f"{o['op']} {o['shape']} {o['dtype']}") for o in result["ops"])
    for o in result["ops"]:
        name = f"{o['op']} {o['shape']} {o['dtype']}"
        print(f"  {name:<{w}}  {o['summary']}")
    return 0


def _no_empty_items(text: str, what: str) -> str:
    """A comma list with an empty item (`1,,2`, `1,2,`) is a typo, refused rather than read as `1,2`."""
    if ".." not in text and any(not x.strip() for x in text.split(",")):
        raise DivergenceInputError(f"bad {what} {text!r}: an empty item in the comma list")
    return text


def _probe_tp(args, rows) -> int:
    """`probe --tp N`, run on each of the N ranks; rank 0 reports."""
    import mlx.core as mx  # (lazy: loads MLX)

    from ..engine.model.loading import DTYPES, read_config  # (lazy: loads MLX)
    from ..parallel.group import current  # (lazy: loads MLX)
    from ..parallel.allreduce_probe import probe_tp  # (lazy: loads MLX)

    target_dir, _ = default_model_dirs()
    model = Path(args.model or target_dir)
    width = int(read_config(model)["hidden_size"])
    dtypes = [DTYPES[args.dtype]] if args.dtype else [mx.float32, mx.bfloat16]
    tp = current()
    result = probe_tp(tp, width, dtypes, rows)
    result["model"] = str(model)
    if args.json:
        emit_json(result)
        return 0
    env = result["environment"]
    print(f"all-reduce over {tp.size} ranks ({tp.backend}, {env['device']}, MLX {env['mlx']}), "
          f"rows of {model.name}'s hidden width {width}")
    for o in result["allreduce"]:
        order = o["equals_rank_order"]
        same = "every row count" if all(order) else ("no row count" if not any(order) else
                                                     f"{sum(order)} of {len(order)} row counts")
        print(f"  all-reduce {o['shape']} {o['dtype']}  {o['summary']}; equals the rank-order sum at {same}")
    return 0
