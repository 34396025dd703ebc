"""The first run in a fresh process on a GPU: how long MLX's kernel compiles make it, and which.

    python bench/first_run.py --side engine --model-cache DIR     # the engine, B prompts
    python bench/first_run.py --side mlxlm --model-cache DIR      # mlx-lm's BatchGenerator
    python bench/first_run.py --side engine --quick               # the fixture, small: a check

MLX CUDA compiles a kernel module on first use per (primitive, dtype pair) and keeps it
under MLX_PTX_CACHE_DIR (default: the temp dir), so only a machine's first process pays.
This script points MLX_PTX_CACHE_DIR at a new empty directory before MLX starts, so every
invocation measures a fresh machine's first run: the wall time of the first and the second
run of the same batch (the second compiles nothing new), and the modules compiled (the
cache's file names). On a CPU nothing is compiled; the script still runs (the times of the
two runs). Prints one line of JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--side", choices=("engine", "mlxlm"), required=True)
    ap.add_argument("--quick", action="store_true", help="the fixture, 2 prompts of 8 tokens, 4 tokens (a check)")
    ap.add_argument("--model", default="qwen0.5b")
    ap.add_argument("--dtype", default="stored")
    ap.add_argument("--model-cache", default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    if a.quick:
        a.model, a.batch, a.prompt, a.tokens = "fixture", 2, 8, 4
    cache = Path(tempfile.mkdtemp(prefix="mlx-ptx-"))
    os.environ["MLX_PTX_CACHE_DIR"] = str(cache)  # before MLX reads it (at its first compile)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import common as C  # noqa: I001  (sys.path + BLAS before mlx)

    target, _, _ = C.fixture_paths(None, None)
    t = C.load(C.model_path(a.model, target, a.model_cache), None if a.dtype == "stored" else a.dtype)
    once = C.batch_runner(a.side, t, C.prompts(t.encode, a.batch, a.prompt), a.tokens)

    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        once()
        C.sync()
        times.append(time.perf_counter() - t0)
    modules = sorted(p.stem for p in cache.rglob("*.ptx"))
    print(json.dumps({"side": a.side, "label": a.label, "model": a.model, "batch": a.batch, "first_s": times[0],
                      "second_s": times[1], "compiled_s": times[0] - times[1], "modules": modules}), flush=True)


if __name__ == "__main__":
    main()
