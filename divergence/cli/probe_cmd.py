"""`divergence probe`: which row counts give the same bits as M=1, per op shape."""
from __future__ import annotations

from .common import add_model_args, default_model_dirs, emit_json

HELP = "map a backend's batch-invariance: row-count classes of every linear-op shape and of SDPA"


def add_arguments(p) -> None:
    add_model_args(p, draft=False)
    p.add_argument("--rows", default="1..128", help="row counts: A..B or a comma list (default 1..128)")
    p.add_argument("--kv-lens", default="64,256,1024",
                   help="KV lengths to probe SDPA at (query lengths from --rows up to each; default 64,256,1024)")
    p.add_argument("--no-cache", action="store_true", help="measure again instead of using the cached map")
    p.add_argument("--json", action="store_true", help="print a JSON report")


def main(args) -> int:
    from ..engine.model import load_model
    from ..probe import parse_rows, probe_model

    rows = parse_rows(args.rows)
    kv_lens = parse_rows(args.kv_lens, "--kv-lens")
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
