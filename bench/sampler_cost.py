"""What the engine's sampler costs a decode step next to mlx-lm's, at B rows of a large vocabulary.

    python bench/sampler_cost.py                       # R = 8, 64; bf16 + fp32; vocab 151,936
    python bench/sampler_cost.py --rows 8 --dtypes bfloat16 --iters 20 --quick

The engine's `sample_on_device` (greedy ids, the two-stage top-k, the chosen logit, an fp32
logsumexp, one packed array) and mlx-lm's (logits - logsumexp, argmax) on the same fixed
random logits, each queued `--iters` times back to back with mx.async_eval (as a decode loop
queues its steps) and synchronised once: ms per call, and the main thread's CPU ms per call.
A call whose CPU time is far below its wall time waited for the device: its wall time is then
the device's time for that graph. Alternated, medians of --reps.

Writes bench/results/sampler_cost.json (--quick: a temp dir).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import common as C  # noqa: I001  (first: sys.path + BLAS before mlx)
from common import mx

import divergence.engine.sampling as S

VOCAB = 151936


def engine_sampler(top_k: int, want_topk: bool = True):
    def run(logits):
        return S.sample_on_device(logits, top_k=top_k, want_topk=want_topk).arrays()
    return run


def mlxlm_sampler(logits):
    # mlx-lm's BatchGenerator: logprobs = logits - logsumexp; greedy sampler = argmax
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return [mx.argmax(logprobs, axis=-1), logprobs]


def timed(fn, logits, iters: int) -> tuple[float, float]:
    """(wall ms, thread CPU ms) per call over `iters` calls queued back to back."""
    C.sync()
    t, c = time.perf_counter(), time.thread_time()
    keep = []
    for _ in range(iters):
        out = fn(logits)
        mx.async_eval(*out)
        keep.append(out[0])
        if len(keep) > 4:  # let old results go, as a decode loop does
            keep.pop(0)
    C.sync()
    return (time.perf_counter() - t) * 1000 / iters, (time.thread_time() - c) * 1000 / iters


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="8,64")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.quick:
        a.reps, a.iters, a.rows = min(a.reps, 1), min(a.iters, 2), "8"
    a.out = C.out_path("sampler_cost", a.quick, a.out)
    meta = C.meta(a)
    sides = {"engine": engine_sampler(a.top_k), "engine, ids only": engine_sampler(a.top_k, False),
             "mlx-lm": mlxlm_sampler}
    results, rows = [], []
    for dtype in a.dtypes.split(","):
        for r in (int(x) for x in a.rows.split(",")):
            logits = (mx.random.normal((r, a.vocab), key=mx.random.key(r)) * 4).astype(getattr(mx, dtype))
            mx.eval(logits)
            for fn in sides.values():  # warm-up: compiles, allocator
                timed(fn, logits, 3)
            got = {k: [] for k in sides}
            for rep in range(a.reps):
                for name in (list(sides) if rep % 2 == 0 else list(sides)[::-1]):
                    got[name].append(timed(sides[name], logits, a.iters))
            res = {"dtype": dtype, "rows": r, "vocab": a.vocab}
            for name, xs in got.items():
                res[name] = {"ms": C.med([w for w, _ in xs]), "cpu_ms": C.med([c for _, c in xs]),
                             "samples": xs}
            res["engine_over_mlxlm"] = res["engine"]["ms"] / res["mlx-lm"]["ms"]
            results.append(res)
            rows.append([dtype, r] + [C.fmt(res[k][m], 3) for k in sides for m in ("ms", "cpu_ms")]
                        + [C.fmt(res["engine_over_mlxlm"])])
    head = ["dtype", "rows"] + [f"{k} {m}" for k in sides for m in ("ms", "CPU")] + ["engine / mlx-lm"]
    txt = C.table(rows, head)
    print("\n" + txt)
    C.write_json(Path(a.out), {"meta": meta, "device": str(mx.default_device()), "results": results,
                               "table": txt.splitlines()})


if __name__ == "__main__":
    main()
