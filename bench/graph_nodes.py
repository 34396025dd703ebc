"""How many nodes a decode step's graph has, by primitive: the engine vs mlx-lm (issue 33).

    python bench/graph_nodes.py --models qwen0.5b --dtypes stored --batches 8,32    # on the GPU
    python bench/graph_nodes.py --quick                                             # the fixture, CPU

On the H200 both engines are host-bound at small B: a step's time is mostly MLX queueing
its graph (`queue` in profile_engine.py), node by node. So the number of nodes a decode
step asks MLX to evaluate, and of which primitives, says where launches could go. The
engine's step (`Run.launch`'s graph: logits, sample, top-k, the cache's arrays) and
mlx-lm's `BatchGenerator` step (its model call's logits) are taken from one decode step
in the middle of a run of B equal-length prompts and written out with mx.export_to_dot
before they are evaluated; nodes are counted by primitive name. On the CPU, MLX's fast ops
(rms_norm, rope, SDPA) are their fallback graphs, so only GPU counts compare what a GPU
queues. Writes bench/results/graph_nodes.json (--quick: a temp dir).
"""
from __future__ import annotations

import argparse
import collections
import re
import tempfile
from pathlib import Path

import common as C  # noqa: I001  (first: sys.path + BLAS before mlx)
from common import mx

from mlx_lm.generate import BatchGenerator

from divergence.core.events import PREFILL, Observer
from divergence.core.request import Request
from divergence.engine import run as engine_run
from divergence.engine.engine import Engine

LABEL = re.compile(r'label\s*=\s*"([A-Za-z_0-9]+)')


class KvOnly(Observer):
    """A traced run's engine side: K/V hashes and kernel choices asked for, dropped."""

    wants_kv_hashes = wants_kernels = True


def count(arrays) -> collections.Counter:
    with tempfile.NamedTemporaryFile(suffix=".dot") as f:
        mx.export_to_dot(f.name, *arrays)
        return collections.Counter(LABEL.findall(Path(f.name).read_text()))


def engine_graph(loaded, prompts, tokens: int, at: int, traced: bool) -> collections.Counter:
    """Nodes of the engine's decode step `at` (0: the run's first step whose slices all
    decode one row; the prefill of B prompts may take several steps under the token budget)."""
    seen, got, decoding = [0], {}, [False]
    real_eval, real_launch = engine_run.mx.async_eval, engine_run.Run.launch

    def launch(self, state, plan, **kw):
        decoding[0] = bool(plan.slices) and all(s.phase != PREFILL and s.count == 1 for s in plan.slices)
        return real_launch(self, state, plan, **kw)

    def spy(*arrays):
        if decoding[0]:
            if seen[0] == at:
                got["c"] = count(arrays)
            seen[0] += 1
        return real_eval(*arrays)

    eng = Engine(loaded, None, policy="native", stop_at_eos=False, top_k=8, prefill="mlx-lm")
    eng.observers = [KvOnly()] if traced else []
    engine_run.mx.async_eval, engine_run.Run.launch = spy, launch
    try:
        eng.run([Request(f"r{i}", tuple(p), max_tokens=tokens) for i, p in enumerate(prompts)], "concurrent")
    finally:
        engine_run.mx.async_eval, engine_run.Run.launch = real_eval, real_launch
    return got["c"]


def mlx_graph(loaded, prompts, tokens: int, at: int) -> collections.Counter:
    """Nodes of BatchGenerator's decode call `at` (its model's logits)."""
    model = loaded.model
    cls = type(model)
    real, seen, got = cls.__call__, [0], {}

    def call(m, inputs, *a, **k):
        out = real(m, inputs, *a, **k)
        if inputs.shape[1] == 1:
            if seen[0] == at:
                got["c"] = count([out])
            seen[0] += 1
        return out

    cls.__call__ = call
    try:
        gen = BatchGenerator(model, max_tokens=tokens, completion_batch_size=max(32, len(prompts)),
                             prefill_batch_size=len(prompts))
        gen.insert([list(p) for p in prompts], [tokens] * len(prompts))
        while gen.next_generated():
            pass
        gen.close()
    finally:
        cls.__call__ = real
    return got["c"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default=None, help="comma list: fixture, qwen0.5b, qwen0.5b-4bit (default fixture)")
    ap.add_argument("--dtypes", default="stored", help="comma list: stored, float32, bfloat16")
    ap.add_argument("--batches", default="8", help="comma list of B")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--at", type=int, default=6, help="which decode step (from the first)")
    ap.add_argument("--target", default=None)
    ap.add_argument("--model-cache", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    target, _, _ = C.fixture_paths(args.target)
    results, rows = [], []
    for name in (args.models or "fixture").split(","):
        path = C.model_path(name, target, args.model_cache)
        for dtype in args.dtypes.split(","):
            loaded = C.load(path, None if dtype == "stored" else dtype)
            for b in map(int, args.batches.split(",")):
                prompts = C.prompts(loaded.encode, b, args.prompt)
                sides = {
                    "engine": engine_graph(loaded, prompts, args.tokens, args.at, traced=False),
                    "engine traced": engine_graph(loaded, prompts, args.tokens, args.at, traced=True),
                    "mlx-lm": mlx_graph(loaded, prompts, args.tokens, args.at),
                }
                for side, c in sides.items():
                    top = ", ".join(f"{k} {v}" for k, v in c.most_common(8))
                    rows.append([name, dtype, f"B={b}", side, sum(c.values()), top])
                    results.append({"model": name, "dtype": dtype, "batch": b, "side": side,
                                    "nodes": sum(c.values()), "by_primitive": dict(c.most_common())})
    print(C.table(rows, ["model", "dtype", "B", "side", "nodes", "most frequent primitives"]))
    C.write_json(C.out_path("graph_nodes", args.quick, args.out), {"meta": C.meta(args), "results": results})


if __name__ == "__main__":
    main()
