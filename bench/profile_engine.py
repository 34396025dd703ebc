"""Where a decode step's time goes: the engine vs mlx-lm, B=1 and B=8.

    python bench/profile_engine.py                     # fixture + qwen0.5b, float32
    python bench/profile_engine.py --models fixture --dtypes float32,bfloat16 --no-pyinstrument

1. Step breakdown (wall-clock timers wrapped around the engine's functions from
   the outside; nothing in the engine is edited), per decode step (medians over
   all decode steps of all repetitions, robust to other processes' bursts):
   graph build (ModelState.forward_step + sample_on_device: Python only, lazy MLX
   ops), queue (mx.async_eval: on the CPU backend MLX keeps only a few ops in
   flight, so most of the compute happens inside this call), wait (to_host: the
   [rows] ids and [rows, k] top-k to the host), commit (scheduler bookkeeping,
   tokens, events) and the rest of the loop. With the engine's overlap the next
   step is built and queued before this one's wait.
2. mlx-lm side by side: generate_step / BatchGenerator median step interval as shipped
   (async_eval pipelined) and with mx.async_eval replaced by mx.eval (synchronous,
   like the engine): what the overlap buys mlx-lm, and its graph-build time.
3. pyinstrument text profiles of one engine decode run per (model, dtype, B),
   saved to bench/results/profile_<model>_<dtype>_b<B>.txt.

Writes bench/results/profile.json.
"""
from __future__ import annotations

import argparse
import importlib.util
import time
from collections import defaultdict
from pathlib import Path

import common as C  # noqa: I001  (first: sys.path + BLAS before mlx)
from common import mx

import mlx.core as mxc
from mlx_lm.generate import BatchGenerator, generate_step

import divergence.engine.run as E
import divergence.engine.sampling as S
from divergence.engine.engine import Engine
from divergence.core.request import Request

SIZES = {"fixture": dict(prompt=16, tokens=48, reps=3), "qwen0.5b": dict(prompt=16, tokens=8, reps=3)}

T: dict[str, float] = defaultdict(float)
STEPS: list[dict] = []  # one record per engine target step
MODEL_CALLS: list[tuple[float, bool]] = []  # (seconds, decode?) per mlx-lm model call
MLX_QUEUE: list[tuple[float, float]] = []  # (wall s, thread CPU s) per mlx-lm mx.async_eval


def _timed(name, fn):
    """Wall time into T[name]; for mx.async_eval also the thread's CPU time (T["queue_cpu"]):
    MLX's eval blocks (sleeps) once more than 10 command buffers are in flight, so a queue
    whose CPU time is far below its wall time waited for the GPU: the step was GPU-bound."""
    cpu = name == "queue"

    def wrapper(*a, **k):
        t, c = time.perf_counter(), time.thread_time() if cpu else 0.0
        try:
            return fn(*a, **k)
        finally:
            T[name] += time.perf_counter() - t
            if cpu:
                T["queue_cpu"] += time.thread_time() - c

    wrapper.__wrapped__ = fn
    return wrapper


def _timed_commit(fn):
    """Run.commit closes a target step: record its components (deltas of T) and when it ended."""

    def wrapper(self, sched, launch, sampled):
        try:
            return fn(self, sched, launch, sampled)
        finally:
            rec = dict(T)
            rec.update(end=time.perf_counter(), decode=all(s.phase != "prefill" for s in launch.plan.slices),
                       rows=launch.plan.rows)
            STEPS.append(rec)

    return wrapper


class Instrument:
    """Wrap the engine's step functions (and mx.async_eval while the engine runs) with timers."""

    def __enter__(self):
        self.saved = [(E.ModelState, "forward_step"), (S, "sample_on_device"), (E.mx, "async_eval"),
                      (S, "to_host"), (E.Run, "commit")]
        self.orig = [getattr(o, n) for o, n in self.saved]
        names = ["build_forward", "build_sample", "queue", "wait", "commit"]
        for (o, n), f, name in zip(self.saved, self.orig, names):
            setattr(o, n, _timed(name, f))
        setattr(E.Run, "commit", _timed_commit(_timed("commit", self.orig[-1])))
        return self

    def __exit__(self, *exc):
        for (o, n), f in zip(self.saved, self.orig):
            setattr(o, n, f)


class QueueTimer:
    """Time mlx-lm's mx.async_eval calls (wall and thread CPU)."""

    def __enter__(self):
        self.orig = orig = mxc.async_eval

        def wrapper(*a, **k):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return orig(*a, **k)
            finally:
                MLX_QUEUE.append((time.perf_counter() - t, time.thread_time() - c))

        mxc.async_eval = wrapper

    def __exit__(self, *exc):
        mxc.async_eval = self.orig


class SyncEval:
    """mx.async_eval -> mx.eval: mlx-lm without its pipelining."""

    def __enter__(self):
        self.orig = mxc.async_eval
        mxc.async_eval = mxc.eval

    def __exit__(self, *exc):
        mxc.async_eval = self.orig


class ModelCallTimer:
    """Time each mlx-lm model call (graph build only: MLX is lazy); decode = one new token per row."""

    def __init__(self, model):
        self.cls = type(model)

    def __enter__(self):
        self.orig = orig = self.cls.__call__

        def wrapper(m, inputs, *a, **k):
            t = time.perf_counter()
            try:
                return orig(m, inputs, *a, **k)
            finally:
                MODEL_CALLS.append((time.perf_counter() - t, inputs.shape[-1] == 1))

        self.cls.__call__ = wrapper

    def __exit__(self, *exc):
        self.cls.__call__ = self.orig


def engine_steps(eng, prompts, n) -> list[dict]:
    """Per decode step: components (ms) and the wall interval since the previous step ended."""
    T.clear()
    STEPS.clear()
    reqs = [Request(f"r{i}", tuple(p), max_tokens=n) for i, p in enumerate(prompts)]
    C.sync()
    with Instrument():
        eng.run(reqs, "concurrent")
    out = []
    keys = ("build_forward", "build_sample", "queue", "wait", "commit")
    for prev, cur in zip(STEPS, STEPS[1:]):
        if cur["decode"]:
            d = {k: (cur.get(k, 0.0) - prev.get(k, 0.0)) * 1000 for k in keys}
            d["step"] = (cur["end"] - prev["end"]) * 1000
            d["loop"] = d["step"] - sum(d[k] for k in keys)
            d["queue_cpu"] = (cur.get("queue_cpu", 0.0) - prev.get("queue_cpu", 0.0)) * 1000
            out.append(d)
    return out


def mlx_steps(model, prompts, n, sync: bool) -> dict:
    """Per decode step of generate_step (one prompt) or BatchGenerator: interval and graph-build time (ms)."""
    MODEL_CALLS.clear()
    MLX_QUEUE.clear()
    C.sync()
    stamps = []
    with ModelCallTimer(model):
        ctx = SyncEval() if sync else QueueTimer()
        ctx.__enter__()
        try:
            if len(prompts) == 1:
                for _ in generate_step(mx.array(prompts[0]), model, max_tokens=n):
                    stamps.append(time.perf_counter())
            else:
                gen = BatchGenerator(model, max_tokens=n, completion_batch_size=32,
                                     prefill_batch_size=max(8, len(prompts)))
                gen.insert([list(p) for p in prompts], [n] * len(prompts))
                while gen.next_generated():
                    stamps.append(time.perf_counter())
                gen.close()
            C.sync()
        finally:
            ctx.__exit__()
    intervals = [(b - a) * 1000 for a, b in zip(stamps, stamps[1:])]
    builds = [t * 1000 for t, dec in MODEL_CALLS if dec]
    # the decode calls' queues: the prefill's first ones (a few) are left out by the median
    return {"intervals": intervals, "builds": builds, "queue": [w * 1000 for w, _ in MLX_QUEUE],
            "queue_cpu": [c * 1000 for _, c in MLX_QUEUE]}


def breakdown(name, path, dtype, sz, batches, pyinst: bool, outdir: Path) -> dict:
    t = C.load(path, dtype)
    print(f"\n== {name} {t.dtype}", flush=True)
    bmax = max(batches)
    ps = C.prompts(t.encode, bmax, sz["prompt"])
    eng = Engine(t, policy="native", stop_at_eos=False)
    eng.run([Request("w", tuple(ps[0][:8]), max_tokens=2)], "serial")
    mlx_steps(t.model, [ps[0][:8]], 2, False)
    res = {"model": name, "dtype": t.dtype, "sizes": sz, "batches": {}}
    for b in batches:
        eng_steps = []
        mlx = {w: {"intervals": [], "builds": [], "queue": [], "queue_cpu": []} for w in (False, True)}
        for rep in range(sz["reps"]):
            order = ["engine", False, True] if rep % 2 == 0 else [True, False, "engine"]
            for who in order:
                if who == "engine":
                    eng_steps += engine_steps(eng, ps[:b], sz["tokens"])
                else:
                    r = mlx_steps(t.model, ps[:b], sz["tokens"], who)
                    for k in mlx[who]:
                        mlx[who][k] += r[k]
        e = {k: C.med([s[k] for s in eng_steps]) for k in eng_steps[0]}
        build = e["build_forward"] + e["build_sample"]
        host = build + e["wait"] + e["commit"] + e["loop"]
        a_ms, s_ms = C.med(mlx[False]["intervals"]), C.med(mlx[True]["intervals"])
        row = {
            "decode_steps_measured": {"engine": len(eng_steps), "mlx_async": len(mlx[False]["intervals"]),
                                      "mlx_sync": len(mlx[True]["intervals"])},
            "engine_ms_per_step": e["step"],
            "engine_breakdown_ms": {"graph_build": build, "build_forward": e["build_forward"],
                                    "build_sample": e["build_sample"], "queue": e["queue"],
                                    "queue_cpu": e["queue_cpu"], "wait": e["wait"],
                                    "commit_events": e["commit"], "loop_scheduler": e["loop"]},
            "engine_host_ms": host,
            "engine_host_frac": host / e["step"] if e["step"] else None,
            "mlx_async_ms_per_step": a_ms,
            "mlx_sync_ms_per_step": s_ms,
            "mlx_async_gain": s_ms / a_ms if a_ms else None,
            "mlx_graph_build_ms": C.med(mlx[False]["builds"]),
            "mlx_queue_ms": C.med(mlx[False]["queue"]),
            "mlx_queue_cpu_ms": C.med(mlx[False]["queue_cpu"]),
            "engine_speed_vs_mlx_async": a_ms / e["step"] if e["step"] else None,
            "engine_speed_vs_mlx_sync": s_ms / e["step"] if e["step"] else None,
        }
        res["batches"][str(b)] = row
        print(f"   B={b}: engine {e['step']:.2f} ms/step = build {build:.2f} + queue {e['queue']:.2f}"
              f" (CPU {e['queue_cpu']:.2f})"
              f" + wait {e['wait']:.2f} + commit {e['commit']:.2f} + loop {e['loop']:.2f};"
              f" mlx-lm async {a_ms:.2f} sync {s_ms:.2f} (build {row['mlx_graph_build_ms']:.2f},"
              f" queue {row['mlx_queue_ms']:.2f} CPU {row['mlx_queue_cpu_ms']:.2f})", flush=True)
        if pyinst:
            from pyinstrument import Profiler

            prof = Profiler(interval=0.0005)
            reqs = [Request(f"r{i}", tuple(p), max_tokens=sz["tokens"]) for i, p in enumerate(ps[:b])]
            prof.start()
            eng.run(reqs, "concurrent")
            prof.stop()
            f = outdir / f"profile_{name}_{t.dtype}_b{b}.txt"
            f.write_text(prof.output_text(unicode=False, color=False, show_all=False))
            row["pyinstrument"] = str(f.relative_to(C.ROOT) if f.is_relative_to(C.ROOT) else f)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the fixture only, fewer tokens and reps")
    ap.add_argument("--models", default=None, help="default fixture,qwen0.5b (--quick: fixture)")
    ap.add_argument("--dtypes", default="float32", help="comma list; 'stored' keeps the dtype on disk (4-bit)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--no-pyinstrument", action="store_true")
    ap.add_argument("--target", default=None)
    ap.add_argument("--model-cache", default=None)
    ap.add_argument("--tokens", type=int, default=None, help="decode tokens per run (default: per model)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--out", default=None, help="default bench/results/profile.json (--quick: a temp dir)")
    a = ap.parse_args()
    a.models = a.models or ("fixture" if a.quick else "fixture,qwen0.5b")
    if a.quick:  # a check that it runs, not a measurement
        a.tokens, a.reps, a.no_pyinstrument = a.tokens or 4, a.reps or 1, True
    if not a.no_pyinstrument and importlib.util.find_spec("pyinstrument") is None:
        print("[bench] pyinstrument is not installed: no text profiles (pip install pyinstrument)")
        a.no_pyinstrument = True
    a.out = C.out_path("profile", a.quick, a.out)
    meta = C.meta(a)  # at the start: the engine commit that was measured
    t0 = time.perf_counter()
    target, _, where = C.fixture_paths(a.target, None)
    batches = [int(x) for x in a.batches.split(",")]
    out = []
    for name in a.models.split(","):
        path = C.model_path(name, target, a.model_cache)
        for dtype in a.dtypes.split(","):
            sz = dict(SIZES[name.replace("-4bit", "")])
            sz.update({k: v for k, v in (("tokens", a.tokens), ("reps", a.reps)) if v})
            out.append(breakdown(name, path, None if dtype == "stored" else dtype, sz, batches, not a.no_pyinstrument,
                                 a.out.parent))
    rows = []
    for r in out:
        for b, x in r["batches"].items():
            bd = x["engine_breakdown_ms"]
            rows.append([r["model"], r["dtype"], b, C.fmt(x["engine_ms_per_step"]), C.fmt(bd["graph_build"]),
                         C.fmt(bd["queue"]), C.fmt(bd["queue_cpu"]), C.fmt(bd["wait"]), C.fmt(bd["commit_events"]),
                         C.fmt(bd["loop_scheduler"]), C.fmt(x["engine_host_frac"]),
                         C.fmt(x["mlx_async_ms_per_step"]), C.fmt(x["mlx_sync_ms_per_step"]),
                         C.fmt(x["mlx_graph_build_ms"]), C.fmt(x["mlx_queue_ms"]), C.fmt(x["mlx_queue_cpu_ms"]),
                         C.fmt(x["engine_speed_vs_mlx_async"])])
    txt = C.table(rows, ["model", "dtype", "B", "eng ms/step", "build", "queue", "queue CPU", "wait", "commit",
                         "loop", "host frac", "mlx async", "mlx sync", "mlx build", "mlx queue", "mlx queue CPU",
                         "eng/mlx speed"])
    print("\n" + txt)
    C.write_json(Path(a.out), {"meta": meta, "fixture_source": where, "results": out, "table": txt.splitlines(),
                               "seconds": time.perf_counter() - t0})
    print(f"[bench] total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
