"""Where an fp32 decode step's time goes on the CPU, op by op, and which faster forms of
its products keep the bits (issue 13, round 8).

    python bench/exp/cpu_step_parts.py            # 0.5B shape (Qwen2.5: d 896, mlp 4864, vocab 151936)

Times, each alone (median of n calls, evaluated one at a time):
* every linear product of the 0.5B shape at M = 1 and 8, in three forms: the module's
  own `x @ W.T` (W stored [out, in]), `x @ Wt` with W stored transposed ([in, out],
  contiguous) and `(W @ x.T).T`; with whether each form's bits equal the first;
* a grid of bit checks of the `[in, out]` form: (N, K) shapes from the fixture's to the
  vocabulary head's, M from 1 to 128;
* the sampler's `logsumexp` / `argmax` at [8, 151936], and mlx-lm's `swiglu` at [8, 4864].
Prints a table and writes bench/results/cpu_step_parts.json (or --out).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import common as C  # noqa: E402,I001  (first: sys.path + BLAS before mlx)
from common import mx  # noqa: E402

import numpy as np  # noqa: E402
from mlx_lm.models.activations import swiglu  # noqa: E402

from divergence.engine.kernels.blas import blas_in_use, blas_threads  # noqa: E402

D, MLP, KV, VOCAB, LAYERS = 896, 4864, 128, 151936, 24
PRODUCTS = {"q_proj/o_proj": (D, D), "k_proj/v_proj": (KV, D), "gate_proj/up_proj": (MLP, D),
            "down_proj": (D, MLP), "lm_head": (VOCAB, D)}
PER_LAYER = {"q_proj/o_proj": 2, "k_proj/v_proj": 2, "gate_proj/up_proj": 2, "down_proj": 1, "lm_head": 0}
GRID = [(256, 256), (704, 256), (256, 704), (128, 256), (64, 256), (896, 896), (4864, 896), (896, 4864),
        (128, 896), (1000, 256), (32000, 256), (VOCAB, D)]


def timed(fn, *args, n: int) -> float:
    for _ in range(3):
        mx.eval(fn(*args))
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        mx.eval(fn(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def bits_equal(a: mx.array, b: mx.array) -> bool:
    return bool(np.array_equal(np.array(a).view(np.uint32), np.array(b).view(np.uint32)))


def products(reps: int) -> list[dict]:
    rows = []
    for name, (n, k) in PRODUCTS.items():
        w = mx.random.normal((n, k), key=mx.random.key(1))
        wt = mx.contiguous(w.T)
        mx.eval(w, wt)
        for m in (1, 8):
            x = mx.random.normal((m, k), key=mx.random.key(2))
            forms = {"x @ W.T": lambda x: x @ w.T, "x @ Wt": lambda x: x @ wt, "(W @ x.T).T": lambda x: (w @ x.T).T}
            ref = forms["x @ W.T"](x)
            reps_here = max(3, reps // 8) if n == VOCAB else reps
            row = {"op": name, "m": m, "n": n, "k": k}
            for label, f in forms.items():
                row[label] = {"s": timed(lambda x: mx.contiguous(f(x)), x, n=reps_here), "bits_equal": bits_equal(f(x), ref)}
            rows.append(row)
    return rows


def grid() -> dict:
    checked, differ = 0, []
    for n, k in GRID:
        w = mx.random.normal((n, k), key=mx.random.key(3))
        wt = mx.contiguous(w.T)
        for m in ((1, 2, 3, 5, 8, 13, 16, 31, 64, 128) if n * k < 10 ** 7 else (1, 8, 64)):
            x = mx.random.normal((m, k), key=mx.random.key(4 + m))
            checked += 1
            if not bits_equal(x @ w.T, x @ wt):
                differ.append([m, n, k])
    return {"checked": checked, "differ": differ}


def elementwise(reps: int) -> dict:
    x = mx.random.normal((8, VOCAB), key=mx.random.key(5))
    g, u = (mx.random.normal((8, MLP), key=mx.random.key(s)) for s in (6, 7))
    mx.eval(x, g, u)
    return {
        "logsumexp_8x151936_s": timed(lambda a: mx.logsumexp(a, axis=-1, keepdims=True), x, n=reps),
        "argmax_8x151936_s": timed(lambda a: mx.argmax(a, axis=-1), x, n=reps),
        "exp_8x151936_s": timed(mx.exp, x, n=reps),
        "add_8x151936_s": timed(lambda a: a + 1.0, x, n=reps),
        "swiglu_8x4864_s": timed(swiglu, g, u, n=reps),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--out", default=str(C.RESULTS / "cpu_step_parts.json"))
    a = ap.parse_args()
    mx.set_default_device(mx.cpu)
    prods, checks, ew = products(a.reps), grid(), elementwise(a.reps)
    header = ["op", "M", "x @ W.T ms", "x @ Wt ms", "ratio", "bits", "(W @ x.T).T ms", "ratio", "bits"]
    rows = []
    for r in prods:
        base = r["x @ W.T"]["s"]
        rows.append([r["op"], r["m"], f"{base * 1e3:.3f}", f"{r['x @ Wt']['s'] * 1e3:.3f}",
                     f"{base / r['x @ Wt']['s']:.2f}", "same" if r["x @ Wt"]["bits_equal"] else "DIFFER",
                     f"{r['(W @ x.T).T']['s'] * 1e3:.3f}", f"{base / r['(W @ x.T).T']['s']:.2f}",
                     "same" if r["(W @ x.T).T"]["bits_equal"] else "DIFFER"])
    print(C.table(rows, header))
    step8 = {form: sum(r[form]["s"] * (PER_LAYER[r["op"]] * LAYERS or 1) for r in prods if r["m"] == 8)
             for form in ("x @ W.T", "x @ Wt")}
    print(f"\nB=8 products of one step (24 layers + head): x @ W.T {step8['x @ W.T'] * 1e3:.0f} ms, "
          f"x @ Wt {step8['x @ Wt'] * 1e3:.0f} ms")
    print(f"[in, out] bit checks: {checks['checked']} shapes, {len(checks['differ'])} differ {checks['differ']}")
    print(f"logsumexp [8, 151936] {ew['logsumexp_8x151936_s'] * 1e3:.1f} ms, exp {ew['exp_8x151936_s'] * 1e3:.1f} ms,"
          f" add {ew['add_8x151936_s'] * 1e3:.2f} ms; swiglu [8, 4864] {ew['swiglu_8x4864_s'] * 1e3:.2f} ms"
          f" (x {LAYERS} layers: {ew['swiglu_8x4864_s'] * LAYERS * 1e3:.1f} ms)")
    meta = C.meta(a)
    meta.update(blas=blas_in_use(), blas_threads=blas_threads())
    C.write_json(Path(a.out), {"meta": meta, "products": prods, "step_products_b8_s": step8, "bit_grid": checks,
                               "elementwise": ew})


if __name__ == "__main__":
    main()
