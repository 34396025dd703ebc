"""Does the engine give the same bits when it runs the same batch again, in one process?
And if not, where do two runs first part (issue 33's H200 runs: at B >= 8 and 512-4,096
positions the engine's tokens and top-k logits differed between repetitions).

Runs B requests with `context`-token prompts `--runs` times on one Engine, recording every
KV-cache write's hashes (per step, layer, request) and every token's top-k logit bits, and
reports per run whether it equals the first and, where not, the first write that differs:
its step, whether the step was a prefill or a decode, the layer, and K or V. Since a write
depends on everything before it, the first differing write names the op that went its own
way (the layer's attention or linear ops, in that step).

    python bench/repeat_check.py --models qwen0.5b --dtypes stored --points 8:1024   # GPU
    python bench/repeat_check.py --quick                                             # CPU
"""
from __future__ import annotations

import argparse

import common as C  # noqa: I001  (first: sys.path + BLAS before mlx)
from common import mx  # noqa: F401

import numpy as np

from divergence.core.events import Observer
from divergence.core.request import Request
from divergence.engine.engine import Engine


class Record(Observer):
    wants_kv_hashes = True

    def __init__(self):
        self.writes, self.tokens, self.phase = [], [], {}

    def on_step(self, e):
        self.phase[e.plan.index] = ",".join(sorted({s.phase for s in e.plan.slices}))

    def on_kv_write(self, w):
        self.writes.append(((w.step, w.layer, w.request_id), w.k_hashes.tobytes(), w.v_hashes.tobytes()))

    def on_token(self, t):
        self.tokens.append((t.step, t.request_id, t.token, t.topk_logits.view(np.uint32).tobytes()))


def first_difference(a: Record, b: Record) -> dict | None:
    for (key, ka, va), (key_b, kb, vb) in zip(a.writes, b.writes):
        if key != key_b:
            return {"what": "schedule", "at": key}
        if ka != kb or va != vb:
            step, layer, rid = key
            return {"what": "kv", "step": step, "phase": a.phase.get(step), "layer": layer, "request": rid,
                    "k_differs": ka != kb, "v_differs": va != vb}
    if a.tokens != b.tokens:
        return {"what": "tokens only"}
    return None


def check(eng_model, prompts, n: int, runs: int, policy: str = "native") -> list[dict | None]:
    recs = []
    for _ in range(runs):
        rec = Record()
        eng = Engine(eng_model, policy=policy, stop_at_eos=False, observers=[rec], prefill="mlx-lm",
                     token_budget=max(4096, sum(len(p) for p in prompts)))
        eng.run([Request(f"r{i}", tuple(p), max_tokens=n) for i, p in enumerate(prompts)], "concurrent")
        recs.append(rec)
    return [first_difference(recs[0], r) for r in recs[1:]]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=None)
    ap.add_argument("--dtypes", default=None)
    ap.add_argument("--points", default=None, help="B:context,... (default 8:1024,32:512)")
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--policy", default="native", help="the engine's kernel policy (default native)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model-cache", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    target, _, _ = C.fixture_paths()
    models = (args.models or ("fixture" if args.quick else "qwen0.5b")).split(",")
    dtypes = (args.dtypes or ("float32" if args.quick else "bfloat16")).split(",")
    pts = args.points or ("4:32" if args.quick else "8:1024,32:512")
    pts = [tuple(int(x) for x in p.split(":")) for p in pts.split(",")]
    results = []
    for m in models:
        for d in dtypes:
            t = C.load(C.model_path(m, target, args.model_cache), None if d == "stored" else d)
            for b, c in pts:
                diffs = check(t, C.prompts(t.encode, b, c), args.tokens, args.runs, args.policy)
                same = sum(x is None for x in diffs)
                print(f"{m} {t.dtype} {args.policy} B={b} context={c}: {same}/{len(diffs)} runs equal the first",
                      flush=True)
                for i, x in enumerate(diffs):
                    if x is not None:
                        print(f"   run {i + 2}: first difference {x}", flush=True)
                results.append({"model": m, "dtype": t.dtype, "policy": args.policy, "batch": b, "context": c,
                                "runs": args.runs,
                                "differences": diffs})
    out = C.out_path("repeat_check", args.quick, args.out)
    C.write_json(out, {"meta": C.meta(args), "results": results})
    print(f"[bench] wrote {out}")


if __name__ == "__main__":
    main()
