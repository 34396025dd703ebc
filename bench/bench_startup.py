"""Start-up: from a loaded model to the first step of a traced run, with the native-class
signatures and backend proofs probed (cold: what a process pays on a new backend) and read
from the user cache dir (warm: every later process).

    python bench/bench_startup.py                  # fixture + qwen0.5b shape, float32, 7 reps
    python bench/bench_startup.py --quick          # the fixture, 1 rep: a check

Each repetition starts as a new process would, after loading the model: empty in-memory
stores (signatures, proofs, the vocabulary table), a new Engine and TraceWriter, 8 requests
(concurrent). `first step` is the time from constructing the engine to the first step's
event. mlx-lm's BatchGenerator on the same prompts, from its construction to its first
tokens, runs beside them (cold, warm and mlx-lm alternate): the engine's start-up overhead
is its first step minus mlx-lm's, paired per rep (the prefill's compute is both sides'
cost; on the CPU MLX computes most of a graph inside async_eval, so the time to the step's
graph queued is no start-up time to read off either). Goal (issue 33): overhead <= 0.1 s on the 0.5B shape. Writes bench/results/startup.json (--quick: a temp
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
    backend_proofs._flush_all()  # the last rep's stores: a new process has none to write first
    native_classes.SIGNATURES = backend_proofs.BackendStore("native-classes")
    backend_proofs.PROOFS = backend_proofs.BackendProofs()  # row_alone_is_exact reads the module's
    loaded.info.pop("_vocab_pieces", None)


def mlx_lm_first_token(loaded, reqs) -> float:
    """mlx-lm's BatchGenerator on the same prompts: seconds from constructing it to its first
    tokens (the same prefill compute, none of the engine's probes, events or trace)."""
    from mlx_lm.generate import BatchGenerator

    C.sync()
    t0 = time.perf_counter()
    gen = BatchGenerator(loaded.model, max_tokens=2, completion_batch_size=32, prefill_batch_size=len(reqs))
    gen.insert([list(r.prompt_tokens) for r in reqs], [2] * len(reqs))
    while not gen.next_generated():
        pass
    at = time.perf_counter() - t0
    gen.close()
    C.sync()
    return at


def one(loaded, reqs, cache: str, tmp: Path) -> float:
    """Seconds from a loaded model to the first step's event."""
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
    a.reps = 1 if a.quick else max(5, a.reps)
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
            mlx_lm_first_token(loaded, reqs)  # warms mlx-lm's graphs as the engine's were
            got, mlx = {"off": [], "on": []}, []
            for rep in range(a.reps):
                for mode in (("off", "on", "mlx-lm") if rep % 2 else ("mlx-lm", "on", "off")):
                    if mode == "mlx-lm":
                        mlx.append(mlx_lm_first_token(loaded, reqs))
                    else:
                        got[mode].append(one(loaded, reqs, mode, Path(tmp)))
            cold, warm = got["off"], got["on"]
            r = {"model": name, "dtype": a.dtype, "cold_s": C.summary(cold), "warm_s": C.summary(warm),
                 "warm_over_cold": C.paired_ratio(warm, cold), "goal_s": GOAL_S,
                 "mlx_lm_first_token_s": C.summary(mlx),
                 # what the engine's start costs beyond the compute both pay, paired per rep
                 "warm_overhead_s": C.summary([e - m for e, m in zip(warm, mlx)]),
                 "cold_overhead_s": C.summary([e - m for e, m in zip(cold, mlx)])}
            results.append(r)
            over = r["warm_overhead_s"]["median"]
            rows.append([name, a.dtype, C.fmt(r["cold_s"]["median"], 3),
                         C.fmt(r["warm_s"]["median"], 3), C.fmt(r["mlx_lm_first_token_s"]["median"], 3),
                         C.fmt(r["cold_overhead_s"]["median"], 3), C.fmt(over, 3), "yes" if over <= GOAL_S else "NO"])
    if saved is None:
        os.environ.pop(backend_proofs.OFF_ENV, None)
    txt = C.table(rows, ["model", "dtype", "1st step s (probed)", "1st step s (cached)", "mlx-lm 1st token s",
                         "overhead s (probed)", "overhead s (cached)", f"<= {GOAL_S} s"])
    print("\n" + txt)
    C.write_json(out, {"meta": meta, "results": results, "table": txt.splitlines()})


if __name__ == "__main__":
    main()
