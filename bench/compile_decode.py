"""What `mx.compile` buys a decode step, and whether it keeps mlx-lm's bits (issue 33).

    python bench/compile_decode.py --models qwen0.5b --dtypes bfloat16     # on the GPU
    python bench/compile_decode.py --quick                                 # the fixture, CPU

Both engines are host-bound on the H200 at small B (a 0.5B step queues ~300 kernels in
~3-5 ms while its weights stream in ~0.2 ms), so what removes launches and graph
building is what could help. mlx-lm's own decode loop (its model, its KVCache, greedy,
async_eval pipelined as generate_step) runs three ways, interleaved per repetition:

* `eager`: as shipped;
* `tail`: each decoder layer's part after attention (residual add, post-attention
  norm, the MLP, residual add) as one `mx.compile`d function: elementwise ops fused,
  its graph traced once per shape;
* `mlp`: only the MLP compiled (mlx-lm's swiglu is compiled already).

The attention half stays eager in every variant: its KV-cache update is a slice write
into a buffer that grows, which a compiled function cannot take without a recompile per
length. Reported: ms per token (median step interval) and whether every step's logits
equal `eager`'s bit for bit: a fused op that changes one rounding changes the numbers,
and the engine may only adopt what keeps them. Writes bench/results/compile.json
(--quick: a temp dir).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import common as C  # noqa: I001  (first: sys.path + BLAS before mlx)
from common import mx

import numpy as np
from mlx_lm.models.cache import make_prompt_cache

VARIANTS = ("eager", "tail", "mlp")


class CompiledTail:
    """A decoder layer whose post-attention half runs as one compiled function."""

    def __init__(self, layer, mode: str):
        self.layer, self.mode = layer, mode
        self.self_attn, self.input_layernorm = layer.self_attn, layer.input_layernorm
        mlp, norm = layer.mlp, layer.post_attention_layernorm

        def tail(x, r):
            h = x + r
            return h + mlp(norm(h))

        self.tail = mx.compile(tail)
        self.mlp = mx.compile(lambda h: mlp(h))
        self.norm = norm

    def __getattr__(self, name):  # what the model asks of its layers (use_sliding, ...)
        return getattr(self.layer, name)

    def __call__(self, x, mask=None, cache=None):
        r = self.self_attn(self.input_layernorm(x), mask, cache)
        if self.mode == "tail":
            return self.tail(x, r)
        h = x + r
        return h + self.mlp(self.norm(h))


def decode(model, prompt: list[int], n: int, layers) -> tuple[float, list[np.ndarray], list[int]]:
    """generate_step's loop (greedy, the next step queued before this one's token is read)
    over `layers`; returns (ms per token from the median step interval, logits, tokens)."""
    inner = model.model
    saved = inner.layers
    cache = make_prompt_cache(model)
    inner.layers = layers
    try:
        y = mx.array(prompt)
        logits_seen, toks, stamps = [], [], []

        def step(y):
            logits = model(y[None], cache=cache)[:, -1, :]
            return mx.argmax(logits, axis=-1), logits

        nxt, lg = step(y)
        mx.async_eval(nxt, lg)
        for _ in range(n):
            cur, cur_lg = nxt, lg
            nxt, lg = step(cur)
            mx.async_eval(nxt, lg)
            toks.append(int(cur.item()))
            logits_seen.append(np.array(cur_lg.astype(mx.float32)))
            stamps.append(time.perf_counter())
        mx.eval(nxt, lg)
    finally:
        inner.layers = saved
    gaps = np.diff(stamps)
    return float(np.median(gaps)) * 1000, logits_seen, toks


def bench_model(name: str, path, dtype, n: int, reps: int) -> dict:
    t = C.load(path, dtype)
    model = t.model
    prompt = C.prompts(t.encode, 1, 32)[0]
    eager = list(model.model.layers)
    layers = {"eager": eager, "tail": [CompiledTail(la, "tail") for la in eager],
              "mlp": [CompiledTail(la, "mlp") for la in eager]}
    for v in VARIANTS:  # warm-up: compiles, and on CUDA the first run of a shape builds kernels
        decode(model, prompt, 4, layers[v])
    ms = {v: [] for v in VARIANTS}
    ref_logits = ref_toks = None
    same = {v: True for v in VARIANTS}
    for rep in range(reps):
        order = VARIANTS if rep % 2 == 0 else VARIANTS[::-1]
        for v in order:
            m, lg, tk = decode(model, prompt, n, layers[v])
            ms[v].append(m)
            if v == "eager" and ref_logits is None:
                ref_logits, ref_toks = lg, tk
        # bits: every variant's logits against eager's first run (the same prompt, greedy)
    for v in VARIANTS:
        _, lg, tk = decode(model, prompt, n, layers[v])
        same[v] = tk == ref_toks and all(np.array_equal(a, b) for a, b in zip(lg, ref_logits))
    row = {"model": name, "dtype": t.dtype, "tokens": n, "reps": reps,
           "ms_per_token": {v: C.med(ms[v]) for v in VARIANTS}, "samples_ms": ms,
           "speedup_vs_eager": {v: C.paired_ratio(ms["eager"], ms[v]) for v in VARIANTS[1:]},
           "same_bits_as_eager": same}
    print(C.table([[name, t.dtype, v, C.fmt(row["ms_per_token"][v], 3),
                    C.fmt(row["speedup_vs_eager"].get(v, 1.0)), same[v]] for v in VARIANTS],
                  ["model", "dtype", "variant", "ms/token", "eager/variant", "same bits"]), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=None, help="comma list (default qwen0.5b; --quick: fixture)")
    ap.add_argument("--dtypes", default="bfloat16", help="comma list: float32, bfloat16, stored")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--model-cache", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    meta = C.meta(a)
    target, _draft, _where = C.fixture_paths()
    n = a.tokens or (16 if a.quick else 64)
    results = []
    for name in (a.models or ("fixture" if a.quick else "qwen0.5b")).split(","):
        path = C.model_path(name.strip(), target, a.model_cache)
        for dtype in a.dtypes.split(","):
            results.append(bench_model(name.strip(), path, None if dtype == "stored" else dtype, n,
                                       max(3, a.reps)))
    out = C.out_path("compile", a.quick, a.out)
    C.write_json(Path(out), {"meta": meta, "results": results})
    print(f"[bench] -> {out}")


if __name__ == "__main__":
    main()
