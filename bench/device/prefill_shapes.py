"""Does a prompt length never seen before cost a kernel compile? The first prefill of each new
length against the second, on one side per process (issue 47: `divergence serve`'s time to
first token was 3.2x mlx_lm.server's; suspect: a compile per new packed prefill shape).

    python bench/device/prefill_shapes.py --side engine --model-cache DIR
    python bench/device/prefill_shapes.py --side mlxlm --model-cache DIR
    python bench/device/prefill_shapes.py --side engine --quick           # the fixture (a check)

MLX_PTX_CACHE_DIR points at a new empty directory before MLX starts, so every kernel module
the process compiles shows up there. A warm-up prefill of one length runs first (what any
first step compiles). Then, for each length of a list none of which ran before: one request
of that many prompt tokens, max_tokens 2, timed to its first token (the engine: Run wall to
its first step's end; mlx-lm: generate_step to its first token) and the modules compiled
meanwhile; then the same lengths again (nothing new to compile). --packed N: each request
comes with N - 1 others of other new lengths, all prefilled in one packed step (the
engine; mlx-lm prefills them one by one). Prints a table and one line of JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

LENGTHS = (37, 61, 113, 179, 253, 389, 517, 777)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--side", choices=("engine", "mlxlm"), required=True)
    ap.add_argument("--quick", action="store_true", help="the fixture, short lengths (a check)")
    ap.add_argument("--model", default="qwen0.5b")
    ap.add_argument("--model-cache", default=None)
    ap.add_argument("--packed", type=int, default=1, help="requests prefilled together (the engine)")
    a = ap.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="mlx-ptx-"))
    os.environ["MLX_PTX_CACHE_DIR"] = str(cache)  # before MLX reads it (at its first compile)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import common as C  # noqa: I001  (sys.path + BLAS before mlx)
    from common import mx

    target, _, _ = C.fixture_paths(None, None)
    model = "fixture" if a.quick else a.model
    t = C.load(C.model_path(model, target, a.model_cache), None)
    lengths = tuple(n // 4 + 3 for n in LENGTHS) if a.quick else LENGTHS
    stream = C.token_stream(t.encode, 4 * max(lengths) * a.packed + 64)

    def modules() -> set:
        return {p.stem for p in cache.rglob("*.ptx")}

    if a.side == "engine":
        from divergence.core.request import Request
        from divergence.engine.engine import Engine

        clock = C.Clock()
        eng = Engine(t, policy="native", stop_at_eos=False, token_budget=max(256, a.packed * max(lengths) + 8),
                     observers=[clock])

        def first_token(ns: list[int], offset: int) -> float:
            reqs = [Request(f"r{i}", tuple(stream[offset + 97 * i: offset + 97 * i + n]), max_tokens=2)
                    for i, n in enumerate(ns)]
            t0 = time.perf_counter()
            eng.run(reqs, "concurrent")
            return clock.steps[0].t - t0
    else:
        from mlx_lm.generate import generate_step

        def first_token(ns: list[int], offset: int) -> float:
            t0 = time.perf_counter()
            for i, n in enumerate(ns):
                for _tok, _ in generate_step(mx.array(stream[offset + 97 * i: offset + 97 * i + n]), t.model,
                                             max_tokens=2):
                    break
                C.sync()
            return time.perf_counter() - t0

    first_token([29], 0)  # warm-up: a length not in the list
    C.sync()
    rows = []
    for rnd in ("new", "seen"):
        for j, n in enumerate(lengths):
            # the packed companions: other lengths, new in the first round too
            ns = [n] + [n + 7 * k + 1 for k in range(1, a.packed)]
            before = modules()
            s = first_token(ns, 11 * j)
            C.sync()
            rows.append({"round": rnd, "lengths": ns, "ms": s * 1000, "modules": sorted(modules() - before)})
    new = [r["ms"] for r in rows if r["round"] == "new"]
    seen = [r["ms"] for r in rows if r["round"] == "seen"]
    print(C.table([[r["round"], ",".join(map(str, r["lengths"])), C.fmt(r["ms"], 1), len(r["modules"]),
                    " ".join(r["modules"])[:80]] for r in rows], ["round", "prompt tokens", "ms", "modules", "names"]))
    print(json.dumps({"side": a.side, "model": model, "packed": a.packed, "device": str(mx.default_device()),
                      "median_new_ms": statistics.median(new), "median_seen_ms": statistics.median(seen),
                      "new_over_seen": statistics.median([x / y for x, y in zip(new, seen)]), "rows": rows}),
          flush=True)


if __name__ == "__main__":
    main()
