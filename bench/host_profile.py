"""One side's decode steps, long enough for a sampling profiler to see where the host's time goes.

    py-spy record --native --format raw -o engine.txt -- python bench/host_profile.py --side engine --batch 64
    py-spy record --native --format raw -o mlxlm.txt -- python bench/host_profile.py --side mlxlm --batch 64
    python bench/host_profile.py --summarize engine.txt mlxlm.txt    # the native frames under mx.async_eval
    python bench/host_profile.py --side engine --quick              # the fixture, small: a check

`--side engine` runs the engine (native policy, untraced) on B prompts, `--side mlxlm`
mlx-lm's BatchGenerator on the same prompts; both warm up once at the same shape first,
then run `--runs` times and print their ms a step (prefill steps included). `--summarize` reads py-spy's
raw (collapsed) stacks and prints, per file, the share of samples under mx.async_eval and,
within it, the named native functions that hold the most samples (self and inclusive),
kernel compilation left out (a first use's, not a step's): where MLX's host time goes on
each side. Sample at ~40 Hz: with --native, py-spy at 400 Hz fell minutes behind on the
H200's many CUDA threads (issue 33: the engine's queue grows with B at a constant
node count, round 6).
"""
from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path


# frames of one-time work: MLX's JIT kernels (nvrtc, cached on disk after the first process),
# cuDNN's plan building. py-spy's samples of the warm-up hold them, not the steps'
COMPILING = ("nvrtc", "JitModule", "build_plans")


def run_side(a) -> None:
    import common as C  # noqa: I001  (first: sys.path + BLAS before mlx)

    target, _, _ = C.fixture_paths(None, None)
    t = C.load(C.model_path(a.model, target, a.model_cache), None if a.dtype == "stored" else a.dtype)
    once = C.batch_runner(a.side, t, C.prompts(t.encode, a.batch, a.prompt), a.tokens)
    once()  # warm-up: kernels compiled, buffers cached at this shape
    C.sync()
    t0 = time.perf_counter()
    steps = sum(once() for _ in range(a.runs))
    C.sync()
    dt = time.perf_counter() - t0
    print(f"{a.side} B={a.batch} prompt={a.prompt} tokens={a.tokens}: {dt * 1000 / steps:.2f} ms a step "
          f"({steps} steps, prefill included)", flush=True)


def summarize(paths: list[str], top: int) -> None:
    for p in paths:
        total, under, compiling = 0, 0, 0
        self_c, incl_c = Counter(), Counter()
        for line in Path(p).read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            if not stack or not n.isdigit():
                continue
            n = int(n)
            total += n
            frames = stack.split(";")
            at = next((i for i, f in enumerate(frames) if "async_eval" in f), None)
            if at is None:
                continue
            if any(mark in f for f in frames for mark in COMPILING):  # once per process: not a step's cost
                compiling += n
                continue
            under += n
            inner = [f.split(" (")[0] for f in frames[at + 1:] if not f.startswith("0x")]
            if inner:
                self_c[inner[-1]] += n
            for f in set(inner):
                incl_c[f] += n
        print(f"== {p}: {total} samples; under async_eval {under} ({under / max(total, 1):.0%}), and {compiling}"
              f" more compiling kernels (JIT, cuDNN plans: first use in the process, left out below)")
        print("   self:")
        for f, n in self_c.most_common(top):
            print(f"   {n:6d} {n / max(under, 1):6.1%}  {f[:140]}")
        print("   inclusive:")
        for f, n in incl_c.most_common(top):
            print(f"   {n:6d} {n / max(under, 1):6.1%}  {f[:140]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--side", choices=("engine", "mlxlm"))
    ap.add_argument("--summarize", nargs="+", default=None, help="py-spy raw files to summarize")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--model", default="qwen0.5b")
    ap.add_argument("--dtype", default="stored")
    ap.add_argument("--model-cache", default=None)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="the fixture, B=2, 4 tokens, 1 run (a check)")
    a = ap.parse_args()
    if a.quick:
        a.model, a.batch, a.prompt, a.tokens, a.runs = "fixture", 2, 8, 4, 1
    if a.summarize:
        summarize(a.summarize, a.top)
    elif a.side:
        run_side(a)
    else:
        ap.error("--side or --summarize")


if __name__ == "__main__":
    main()
