"""Mixture-of-experts decode next to mlx-lm, and seed 002's two factors on this engine.

    python bench/bench_moe.py                  # qwen3_moe 8 layers, d=512, 16 experts, top-2; fp32 + 4-bit
    python bench/bench_moe.py --quick          # fewer tokens, 3 repetitions
    python bench/bench_moe.py --formats float32

Per format, interleaved in every repetition (order flipped each one), medians:

* B=1 decode tok/s: the engine (`native`) vs mlx-lm `generate_step`;
  B=8 aggregate decode tok/s: the engine (`concurrent`) vs `BatchGenerator`;
  amortized ms/token (1000 / aggregate) at each B.
* Seed 002's reading, `per-token speedup = byte ratio x bandwidth ratio`, for
  the experts op alone: from the engine's own routing records of the B=8 run,
  the experts touched per decode step and layer (coverage; expected under
  uniform routing E * (1 - (1 - k/E)^B)), the expert bytes read per token at
  B=1 and B=8 (byte ratio), and the experts op's time per decode step (every
  MoE layer, each on its own recorded routing, so the weights are not
  cache-hot) at B=8 and for each request alone (bandwidth = bytes touched /
  time; bandwidth ratio). The product
  equals the measured per-token speedup of the op by construction: the point
  is which factor carries it. A large-buffer bandwidth ceiling says how much
  room B=1 left.

bf16 with dense experts is not measured: mlx's CPU gather_mm is float32-only,
so mlx-lm cannot run it here (the engine can; see divergence/engine/kernels/experts.py).
Writes bench/results/moe.json.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import common as C  # noqa: I001  (first: sys.path + BLAS before mlx)
from common import mx

import numpy as np

from bench_engine import engine_batch, mlx_batch, mlx_single
from divergence.core.events import Observer
from divergence.core.policy import KernelPolicy
from divergence.core.request import Request
from divergence.engine.kernels.dispatch import KernelDispatcher
from divergence.engine.engine import Engine
from divergence.engine.kernels.experts import run_experts
from divergence.engine.model.forward import PackedForward

SHAPE = dict(model_type="qwen3_moe", hidden_size=512, num_layers=8, heads=8, kv_heads=4, intermediate_size=1024,
             moe_intermediate_size=512, num_experts=16, experts_per_token=2)
FORMATS = {"float32": dict(dtype="float32"), "4bit": dict(dtype="bfloat16", quantize_bits=4)}
# 4-bit experts are slow on mlx's CPU (bf16 gather_qmm: ~2 tok/s at this shape): shorter runs
SIZES = {"float32": dict(prompt=32, tokens=32, batches=(1, 8), reps=5),
         "4bit": dict(prompt=16, tokens=10, batches=(1, 8), reps=3)}
QUICK = {"float32": dict(prompt=8, tokens=4, batches=(1, 2), reps=1),  # a check, not a measurement
         "4bit": dict(prompt=8, tokens=6, batches=(1, 8), reps=3)}


class Routes(Observer):
    """Decode-step routing of every MoE layer: step -> layer -> [B, k] experts."""

    wants_routing = True

    def __init__(self):
        self.by_step: dict[int, dict[int, list]] = {}
        self.decode_steps: set[int] = set()

    def on_run_start(self, info) -> None:
        self.by_step, self.decode_steps = {}, set()

    def on_routing(self, r) -> None:
        self.by_step.setdefault(r.step, {}).setdefault(r.layer, []).append(r.experts)

    def on_step(self, event) -> None:
        if all(s.phase == "decode" for s in event.plan.slices):
            self.decode_steps.add(event.plan.index)


def model_path(fmt: str, tokenizer_from: Path, cache=None) -> Path:
    from divergence.testing.models import make_random_model

    base = Path(cache) if cache else Path(tempfile.gettempdir()) / "divergence-bench"
    path = base / f"qwen3moe-8L-d512-16e-top2-{fmt}"
    if not C._is_model_dir(path):
        print(f"[bench] generating {path} ...", flush=True)
        make_random_model(path, tokenizer_from=tokenizer_from, **SHAPE, **FORMATS[fmt])
    return path


def expert_bytes(block) -> int:
    """Bytes one expert's three matrices occupy (what a token routed to it must read)."""
    total = 0
    for sw in (block.experts.module.up_proj, block.experts.module.gate_proj, block.experts.module.down_proj):
        for name in ("weight", "scales", "biases"):
            if name in sw:
                total += sw[name].nbytes // block.num_experts
    return total


def bandwidth_ceiling_gbs(mb: int = 512, reps: int = 5) -> float:
    """Large-buffer memory bandwidth (numpy over `mb` MB, far past the caches): the best of a
    read-only sum and a copy (read + write bytes). MLX's CPU reductions run below it."""
    a = np.ones(mb * 2**20 // 4, np.float32)
    b = np.empty_like(a)
    best = 0.0
    for fn, nbytes in ((lambda: a.sum(), a.nbytes), (lambda: np.copyto(b, a), 2 * a.nbytes)):
        t = min(_timed(fn) for _ in range(reps))
        best = max(best, nbytes / t / 1e9)
    return best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def time_experts(blocks, x, routing: dict, reps: int = 3) -> float:
    """Median seconds of the native experts op of every MoE layer on these rows, each layer
    with its own recorded routing: all layers' weights are touched, so they are not cache-hot."""
    d = KernelDispatcher(KernelPolicy.parse("native"), "target")
    d.begin_step(0)
    inds = {li: mx.array(r) for li, r in routing.items()}
    ts = []
    for _ in range(reps):
        mx.eval(x, *inds.values())
        t0 = time.perf_counter()
        mx.eval(*(run_experts(x, inds[li], blocks[li].experts, d, li) for li in inds))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def factors(loaded, routes: Routes, b: int) -> dict:
    """Seed 002's factors for the experts op (all MoE layers of one decode step), B=1 vs
    B=b, on the real routings of the B=b run's full decode steps."""
    fwd = PackedForward(loaded)
    blocks = {li: m for li, m in enumerate(fwd.moe) if m is not None}
    block = next(iter(blocks.values()))
    e, k = block.num_experts, block.top_k
    steps = sorted(s for s in routes.decode_steps if s in routes.by_step)
    full = [s for s in steps if all(len(np.concatenate(v)) == b for v in routes.by_step[s].values())]
    if not full:
        return {}
    cover = [len(np.unique(np.concatenate(v))) for s in full for v in routes.by_step[s].values()]
    coverage = statistics.mean(cover)
    ebytes = expert_bytes(block)
    x = mx.random.normal((b, block.experts.hidden), key=mx.random.key(1)).astype(loaded.model.model.norm.weight.dtype)
    t_b, t_1 = [], []
    for s in full[:6]:
        routing = {li: np.concatenate(v).astype(np.int32) for li, v in routes.by_step[s].items()}
        t_b.append(time_experts(blocks, x, routing))
        t_1.append(statistics.mean(time_experts(blocks, x[i:i + 1], {li: r[i:i + 1] for li, r in routing.items()})
                                   for i in range(b)))
    tb, t1 = statistics.median(t_b), statistics.median(t_1)
    layers = len(blocks)
    bytes_1, bytes_b = layers * k * ebytes, layers * coverage * ebytes  # per call (one step, all layers)
    bw_1, bw_b = bytes_1 / t1 / 1e9, bytes_b / tb / 1e9
    byte_ratio = (bytes_1 / 1) / (bytes_b / b)
    return {
        "experts": e, "top_k": k, "moe_layers": layers, "batch": b, "decode_steps_used": len(full),
        "coverage": coverage, "coverage_uniform_expectation": e * (1 - (1 - k / e) ** b),
        "expert_bytes": ebytes, "bytes_per_token_b1": bytes_1, "bytes_per_token_b": bytes_b / b,
        "coverage_b1": k, "experts_op_s_b1": t1, "experts_op_s_b": tb,
        "experts_op_ms_per_token_b1": 1000 * t1, "experts_op_ms_per_token_b": 1000 * tb / b,
        "bandwidth_gbs_b1": bw_1, "bandwidth_gbs_b": bw_b,
        "byte_ratio": byte_ratio, "bandwidth_ratio": bw_b / bw_1,
        "predicted_per_token_speedup": byte_ratio * bw_b / bw_1,
        "measured_per_token_speedup": t1 / (tb / b),
    }


def bench_format(fmt: str, path: Path, sz: dict) -> dict:
    loaded = C.load(path, None)
    print(f"\n== qwen3_moe {fmt} ({C.num_params(loaded) / 1e6:.1f}M params, {path})", flush=True)
    bmax = max(sz["batches"])
    ps = C.prompts(loaded.encode, bmax, sz["prompt"])
    clock, routes = C.Clock(), Routes()
    eng = Engine(loaded, policy="native", stop_at_eos=False, token_budget=max(256, bmax * sz["prompt"]),
                 observers=[clock])
    model, n = loaded.model, sz["tokens"]
    eng.run([Request("w", tuple(ps[0][:8]), max_tokens=2)], "serial")  # warm-up
    mlx_single(model, ps[0][:8], 2)
    mlx_batch(model, [p[:8] for p in ps[:2]], 2)
    runs = {b: {"engine": [], "mlx_lm": []} for b in sz["batches"]}
    for rep in range(sz["reps"]):
        for b in sz["batches"]:
            mlx = (lambda b=b: mlx_single(model, ps[0], n)) if b == 1 else (lambda b=b: mlx_batch(model, ps[:b], n))
            jobs = [("engine", lambda b=b: engine_batch(eng, clock, ps[:b], n)), ("mlx_lm", mlx)]
            for who, fn in (jobs[::-1] if rep % 2 else jobs):
                runs[b][who].append(fn())
        print(f"   rep {rep + 1}/{sz['reps']}: " + "; ".join(
            f"B={b} engine {C.fmt(runs[b]['engine'][-1]['decode_tok_s'])} mlx-lm "
            f"{C.fmt(runs[b]['mlx_lm'][-1]['decode_tok_s'])} tok/s" for b in sz["batches"]), flush=True)
    # one more B=max run with routing recorded, for the factors (not timed)
    eng.observers = [clock, routes]
    engine_batch(eng, clock, ps[:bmax], n)
    eng.observers = [clock]
    out = {"model": "qwen3_moe", "format": fmt, "shape": SHAPE, "sizes": dict(sz), "batches": {}}
    for b in sz["batches"]:
        e = [r["decode_tok_s"] for r in runs[b]["engine"]]
        m = [r["decode_tok_s"] for r in runs[b]["mlx_lm"]]
        same = sum(a == c for a, c in zip(runs[b]["engine"][0]["tokens"], runs[b]["mlx_lm"][0]["tokens"]))
        out["batches"][str(b)] = {
            "engine_decode_tok_s": C.summary(e), "mlx_lm_decode_tok_s": C.summary(m),
            "ratio": C.paired_ratio(e, m),
            "engine_ms_per_token": 1000 / C.med(e) if C.med(e) else None,
            "mlx_lm_ms_per_token": 1000 / C.med(m) if C.med(m) else None,
            "same_tokens": f"{same}/{b}", "reference": "generate_step" if b == 1 else "BatchGenerator",
        }
    out["seed002_experts_op"] = factors(loaded, routes, bmax)
    return out


def print_table(results: list[dict], ceiling: float) -> str:
    rows = []
    for r in results:
        for b, v in r["batches"].items():
            rows.append([r["format"], f"B={b}", f"vs {v['reference']}", C.fmt(C.med(v["engine_decode_tok_s"]["samples"])),
                         C.fmt(C.med(v["mlx_lm_decode_tok_s"]["samples"])), C.fmt(v["ratio"]),
                         C.fmt(v["engine_ms_per_token"]), C.fmt(v["mlx_lm_ms_per_token"]), v["same_tokens"]])
    txt = C.table(rows, ["format", "B", "reference", "engine tok/s", "mlx-lm tok/s", "ratio", "engine ms/tok",
                         "mlx ms/tok", "same tokens"])
    f_rows = []
    for r in results:
        f = r["seed002_experts_op"]
        if f:
            f_rows.append([r["format"], f"B={f['batch']}", f"{f['coverage']:.2f} / {f['coverage_uniform_expectation']:.2f}",
                           C.fmt(f["byte_ratio"]), C.fmt(f["bandwidth_gbs_b1"]), C.fmt(f["bandwidth_gbs_b"]),
                           C.fmt(f["bandwidth_ratio"]), C.fmt(ceiling / f["bandwidth_gbs_b1"]),
                           C.fmt(f["predicted_per_token_speedup"]), C.fmt(f["measured_per_token_speedup"])])
    txt += "\n\nseed 002 on the experts op (per-token speedup = byte ratio x bandwidth ratio)\n"
    txt += C.table(f_rows, ["format", "B", "coverage (uniform)", "byte ratio", "GB/s B=1", "GB/s B", "bw ratio",
                            "bw ceiling ratio", "byte x bw", "measured"])
    print(txt)
    return txt


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default=None, help="comma list of: float32, 4bit (default both; --quick: float32)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--model-cache", default=None)
    ap.add_argument("--target", default=None, help="tokenizer source (default: the embedded fixture)")
    ap.add_argument("--out", default=None, help="default bench/results/moe.json (--quick: a temp dir)")
    a = ap.parse_args()
    a.formats = a.formats or ("float32" if a.quick else "float32,4bit")
    a.out = C.out_path("moe", a.quick, a.out)
    meta = C.meta(a)
    t_all = time.perf_counter()
    target, _d, _w = C.fixture_paths(a.target, None)
    ceiling = bandwidth_ceiling_gbs()
    print(f"[bench] BLAS: {meta['blas']}; memory-bandwidth ceiling {ceiling:.1f} GB/s", flush=True)
    results = []
    for f in (x.strip() for x in a.formats.split(",")):
        if f not in FORMATS:
            raise SystemExit(f"unknown format {f!r} (expected {', '.join(FORMATS)})")
        sz = dict((QUICK if a.quick else SIZES)[f])
        if a.reps:
            sz["reps"] = max(3, a.reps)
        if a.tokens:
            sz["tokens"] = a.tokens
        results.append(bench_format(f, model_path(f, target, a.model_cache), sz))
    txt = print_table(results, ceiling)
    C.write_json(Path(a.out), {"meta": meta, "bandwidth_ceiling_gbs": ceiling, "results": results,
                               "table": txt.splitlines(), "seconds": time.perf_counter() - t_all})
    print(f"[bench] total {time.perf_counter() - t_all:.0f} s")


if __name__ == "__main__":
    main()
