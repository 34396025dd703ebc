"""The engine's compiled decode step (model/compiled_step.py) against its eager step and mlx-lm.

    python bench/compile_decode.py --quick                            # a check that it runs (the fixture)
    python bench/compile_decode.py --models fixture --dtypes float32,bfloat16,stored
    python bench/compile_decode.py --models qwen0.5b,qwen0.5b-4bit --dtypes stored --batches 1,8,32,64

Per model, dtype and batch size B, three arms interleaved in every repetition (the order
rotates): the engine with its decode steps compiled, the same engine eager (Engine(
compiled_step=True / False); native, prefill="mlx-lm", B prompts of equal length, all at
once), and mlx-lm (generate_step at B=1, BatchGenerator above). Reported, medians over
repetitions:

* ms per decode step (the median step interval of a run) of each arm, and the paired
  ratios eager / compiled and mlx-lm / compiled (> 1: compiled is faster);
* the host's graph-building time per decode step of each engine arm (PackedForward.execute's
  wall time on the decode steps: what compiling removes; the rest of a step is MLX
  encoding, the sampler, the commit and waiting on the device);
* the process's CPU time a generated token of each arm (every thread's; on a machine shared
  with other work, steadier than wall time; the eager prefill's share included);
* whether the compiled runs equal the eager ones bit for bit (tokens, top-k ids and
  logits of every request) and mlx-lm's tokens;
* on a GPU, the time the step's weights take to stream once at the device's memory
  bandwidth: the physical floor of a decode step.

Writes bench/results/compile.json (--quick: a temp dir).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import common as C  # noqa: I001  (first: sys.path + BLAS before mlx)
from common import mx

import numpy as np
from mlx.utils import tree_flatten

from bench_engine import mlx_batch, mlx_single
from divergence.core.request import Request
from divergence.engine.engine import Engine

ARMS = ("compiled", "eager", "mlx_lm")
# memory bandwidth by device name (bytes / s): the weight-streaming floor of a step
BANDWIDTH = {"NVIDIA H200": 4.8e12, "NVIDIA H100 80GB HBM3": 3.35e12}


class BuildTimer:
    """Wraps one engine's forward: the wall time of building each decode step's graph."""

    def __init__(self, fwd):
        self.decode_s: list[float] = []
        inner = fwd.execute

        def execute(prep, *a, **kw):
            t = time.perf_counter()
            out = inner(prep, *a, **kw)
            if prep.decode_queries == 1 and prep.rows == len(prep.plan.slices):
                self.decode_s.append(time.perf_counter() - t)
            return out
        fwd.execute = execute

    def take(self) -> float | None:
        ms = C.med(self.decode_s)
        self.decode_s = []
        return None if ms is None else ms * 1000


def engine_arm(eng: Engine, timer: BuildTimer, clock: C.Clock, prompts, n: int) -> dict:
    reqs = [Request(f"r{i}", tuple(p), max_tokens=n) for i, p in enumerate(prompts)]
    cpu = time.process_time()
    res = eng.run(reqs, "concurrent" if len(reqs) > 1 else "serial")
    cpu = time.process_time() - cpu
    step = clock.split()["step_s_median"]
    outs = [res.outputs[r.id] for r in reqs]
    return {"ms_per_step": None if step is None else step * 1000, "build_ms": timer.take(),
            "cpu_ms_per_token": cpu * 1000 / (len(reqs) * n),
            "tokens": [o.tokens for o in outs],
            "topk": [([a.tolist() for a in o.topk_ids], [a.view(np.uint32).tolist() for a in o.topk_logits])
                     for o in outs]}


def mlx_arm(model, prompts, n: int) -> dict:
    cpu = time.process_time()
    r = mlx_single(model, prompts[0], n) if len(prompts) == 1 else mlx_batch(model, prompts, n)
    cpu = time.process_time() - cpu
    rate = r["decode_tok_s"]
    return {"ms_per_step": len(prompts) * 1000 / rate if rate else None, "tokens": r["tokens"],
            "cpu_ms_per_token": cpu * 1000 / (len(prompts) * n)}


def weight_stream_ms(loaded) -> tuple[int, float | None]:
    nbytes = sum(v.nbytes for _, v in tree_flatten(loaded.model.parameters()))
    if mx.default_device() != mx.gpu:
        return nbytes, None
    bw = BANDWIDTH.get(mx.device_info().get("device_name", ""))
    return nbytes, None if bw is None else nbytes / bw * 1000


def bench_model(name: str, path, dtype, batches, prompt_len: int, n: int, reps: int) -> list[dict]:
    t = C.load(path, dtype)
    nbytes, floor_ms = weight_stream_ms(t)
    ps = C.prompts(t.encode, max(batches), prompt_len)
    clock = C.Clock()
    engines, timers = {}, {}
    for arm in ("compiled", "eager"):
        engines[arm] = Engine(t, policy="native", stop_at_eos=False, prefill="mlx-lm", observers=[clock],
                              token_budget=max(256, max(batches) * prompt_len), compiled_step=arm == "compiled")
        timers[arm] = BuildTimer(engines[arm]._target_fwd)
    rows = []
    for b in batches:
        prompts = ps[:b]
        run = {"compiled": lambda: engine_arm(engines["compiled"], timers["compiled"], clock, prompts, n),
               "eager": lambda: engine_arm(engines["eager"], timers["eager"], clock, prompts, n),
               "mlx_lm": lambda: mlx_arm(t.model, prompts, n)}
        for arm in ARMS:  # warm-up: traces, and on a GPU the first use of each shape builds kernels
            run[arm]()
        got = {a: [] for a in ARMS}
        for rep in range(reps):
            order = ARMS[rep % 3:] + ARMS[:rep % 3]
            for arm in order:
                got[arm].append(run[arm]())
        ms = {a: [r["ms_per_step"] for r in got[a]] for a in ARMS}
        cpu = {a: [r["cpu_ms_per_token"] for r in got[a]] for a in ARMS}
        build = {a: C.med([r["build_ms"] for r in got[a]]) for a in ("compiled", "eager")}
        same = all(c["tokens"] == e["tokens"] and c["topk"] == e["topk"] for c, e in zip(got["compiled"], got["eager"]))
        row = {"model": name, "dtype": t.dtype, "batch": b, "prompt_tokens": prompt_len, "tokens": n, "reps": reps,
               "ms_per_step": {a: C.summary(ms[a]) for a in ARMS},
               "eager_over_compiled": C.paired_ratio(ms["eager"], ms["compiled"]),
               "mlx_lm_over_compiled": C.paired_ratio(ms["mlx_lm"], ms["compiled"]),
               "mlx_lm_over_eager": C.paired_ratio(ms["mlx_lm"], ms["eager"]),
               "build_ms_per_decode_step": build,
               # process CPU time (every thread, MLX's CPU streams included) a generated token, the
               # prefill's share included: on a shared machine steadier than wall time
               "cpu_ms_per_token": {a: C.summary(cpu[a]) for a in ARMS},
               "eager_over_compiled_cpu": C.paired_ratio(cpu["eager"], cpu["compiled"]),
               "mlx_lm_over_compiled_cpu": C.paired_ratio(cpu["mlx_lm"], cpu["compiled"]),
               "compiled_equals_eager": same,
               "tokens_equal_mlx_lm": sum(x == y for x, y in zip(got["compiled"][0]["tokens"], got["mlx_lm"][0]["tokens"])),
               "weight_bytes": nbytes, "weight_stream_ms": floor_ms}
        rows.append(row)
        print(C.table([[name, t.dtype, b, C.fmt(C.med(ms["compiled"]), 3), C.fmt(C.med(ms["eager"]), 3),
                        C.fmt(C.med(ms["mlx_lm"]), 3), C.fmt(row["eager_over_compiled"]),
                        C.fmt(row["mlx_lm_over_compiled"]), C.fmt(row["eager_over_compiled_cpu"]),
                        C.fmt(build["compiled"], 3), C.fmt(build["eager"], 3),
                        same, f"{row['tokens_equal_mlx_lm']}/{b}", C.fmt(floor_ms, 3)]],
                      ["model", "dtype", "B", "compiled ms", "eager ms", "mlx-lm ms", "eager/comp", "mlx-lm/comp",
                       "eager/comp cpu", "build comp", "build eager", "same bits", "= mlx-lm", "floor ms"]), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=None, help="comma list (default fixture)")
    ap.add_argument("--dtypes", default=None, help="comma list: float32, bfloat16, stored (default float32; "
                                                    "a -4bit model: stored only)")
    ap.add_argument("--batches", default=None, help="batch sizes (default 1,8; --quick 1,2)")
    ap.add_argument("--quick", action="store_true", help="a check that it runs: the fixture in fp32, B=1,2, 8 tokens, 1 rep")
    ap.add_argument("--tokens", type=int, default=None, help="tokens generated per request (default 64; --quick 8)")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 5; --quick 1)")
    ap.add_argument("--model-cache", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    meta = C.meta(a)
    target, _draft, _where = C.fixture_paths()
    batches = [int(x) for x in (a.batches or ("1,2" if a.quick else "1,8")).split(",")]
    n = a.tokens or (8 if a.quick else 64)
    reps = max(1, a.reps or (1 if a.quick else 5))
    results = []
    for name in (a.models or "fixture").split(","):
        path = C.model_path(name.strip(), target, a.model_cache)
        # a quantized model runs as stored (its activations in its own dtype), once
        dtypes = ["stored"] if name.strip().endswith("-4bit") else (a.dtypes or "float32").split(",")
        for dtype in dtypes:
            results.append(bench_model(name.strip(), path, None if dtype == "stored" else dtype, batches,
                                       a.prompt, n, reps))
    out = C.out_path("compile", a.quick, a.out)
    C.write_json(Path(out), {"meta": meta, "device": str(mx.default_device()), "results": [r for x in results for r in x]})
    print(f"[bench] -> {out}")


if __name__ == "__main__":
    main()
