"""Start-up: from a loaded model to the first step of a traced run, with the native-class
signatures and backend proofs probed (cold: what a process pays on a new backend) and read
from the user cache dir (warm: every later process).

    python bench/bench_startup.py                  # fixture + qwen0.5b shape, float32, 7 reps
    python bench/bench_startup.py --quick          # the fixture, 5 reps

Each repetition starts as a new process would, after loading the model: empty in-memory
stores (signatures, proofs, the vocabulary table), a new Engine and TraceWriter, 8 requests
(concurrent). `first step` is the time from constructing the engine to the first step's
event; cold and warm alternate, and the ratio is the median of the paired ratios. Goal
(issue 33): <= 0.1 s on the 0.5B shape. Writes bench/results/startup.json (--quick: a temp
dir).
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import common as C  # noqa: I001  (first: sys.path + BLAS before mlx)

from divergence.core.events import Observer
from divergence.core.request import Request
from divergence.engine.engine import Engine
from divergence.engine.kernels import backend_proofs, native_classes
from divergence.trace.writer import TraceWriter

GOAL_S = 0.1


class FirstStep(Observer):
    def __init__(self):
        self.at = None

    def on_step(self, e) -> None:
        if self.at is None:
            self.at = time.perf_counter()


def new_process(loaded) -> None:
    """What a fresh process holds after loading the model: nothing probed, nothing decoded."""
    native_classes.SIGNATURES = backend_proofs.BackendStore("native-classes")
    backend_proofs.PROOFS = backend_proofs.BackendProofs()  # row_alone_is_exact reads the module's
    loaded.info.pop("_vocab_pieces", None)


def one(loaded, reqs, cache: str, tmp: Path) -> float:
    new_process(loaded)
    os.environ[backend_proofs.OFF_ENV] = cache
    first = FirstStep()
    C.sync()
    t0 = time.perf_counter()
    with TraceWriter(tmp / "startup.h5", top_k=8, kv_hashes=True) as w:
        eng = Engine(loaded, None, policy="native", stop_at_eos=False, observers=[w, first])
        eng.run(reqs, "concurrent")
    return first.at - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default=None, help="fixture, qwen0.5b (default both; --quick: fixture)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--model-cache", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    a.models = a.models or ("fixture" if a.quick else "fixture,qwen0.5b")
    a.reps = 5 if a.quick else max(5, a.reps)
    out = C.out_path("startup", a.quick, a.out)
    meta = C.meta(a)
    target, _, _ = C.fixture_paths(None, None)
    results, rows = [], []
    saved = os.environ.get(backend_proofs.OFF_ENV)
    with tempfile.TemporaryDirectory(prefix="divergence-startup-") as tmp:
        os.environ[backend_proofs.CACHE_ENV] = str(Path(tmp) / "cache")  # its own cache: cold is cold
        for name in a.models.split(","):
            loaded = C.load(C.model_path(name.strip(), target, a.model_cache), a.dtype)
            reqs = [Request(f"r{i}", tuple(p), max_tokens=2) for i, p in enumerate(C.prompts(loaded.encode, 8, 16))]
            one(loaded, reqs, "on", Path(tmp))  # fills the cache (and warms MLX's graphs)
            cold, warm = [], []
            for rep in range(a.reps):
                for mode in (("off", "on") if rep % 2 else ("on", "off")):
                    (cold if mode == "off" else warm).append(one(loaded, reqs, mode, Path(tmp)))
            r = {"model": name, "dtype": a.dtype, "cold_s": C.summary(cold), "warm_s": C.summary(warm),
                 "warm_over_cold": C.paired_ratio(warm, cold), "goal_s": GOAL_S}
            results.append(r)
            rows.append([name, a.dtype, C.fmt(r["cold_s"]["median"], 3), C.fmt(r["warm_s"]["median"], 3),
                         C.fmt(r["warm_over_cold"]), "yes" if r["warm_s"]["median"] <= GOAL_S else "NO"])
    if saved is None:
        os.environ.pop(backend_proofs.OFF_ENV, None)
    txt = C.table(rows, ["model", "dtype", "first step s (probed)", "first step s (cached)", "cached/probed",
                         f"<= {GOAL_S} s"])
    print("\n" + txt)
    C.write_json(out, {"meta": meta, "results": results, "table": txt.splitlines()})


if __name__ == "__main__":
    main()
