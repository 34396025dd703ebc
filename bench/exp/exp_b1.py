"""B=1 decode on a GPU: mlx-lm vs engine variants, many interleaved reps (median ms/step)."""
import os, sys, time, statistics
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import common as C
from common import mx
from mlx_lm.generate import generate_step
import divergence.engine.sampling as S
from divergence.engine.engine import Engine
from divergence.core.request import Request
tp, _, _ = C.fixture_paths()
name = sys.argv[1]
path = C.qwen_path(tp, sys.argv[2], bits=4 if "4bit" in name else None)
t = C.load(path, None if "4bit" in name else "bfloat16")
ps = C.prompts(t.encode, 8, 16)
def eng_run(e, n=48):
    st = []
    class O(C.Observer):
        def on_step(self, ev): st.append(time.perf_counter())
    e.observers = [O()]
    e.run([Request("r", tuple(ps[0]), max_tokens=n)], "concurrent")
    e.observers = []
    return statistics.median([b - a for a, b in zip(st, st[1:])]) * 1e3
def mlx_run(n=48):
    st = []
    for _ in generate_step(mx.array(ps[0]), t.model, max_tokens=n): st.append(time.perf_counter())
    return statistics.median([b - a for a, b in zip(st, st[1:])]) * 1e3
orig = S.sample_on_device
def no_topk(logits, **kw):
    kw["want_topk"] = False
    return orig(logits, **kw)
E = {"default": Engine(t, policy="native", stop_at_eos=False), "top_k=1": Engine(t, policy="native", stop_at_eos=False, top_k=1)}
for e in E.values(): eng_run(e, 4)
mlx_run(4)
res = {k: [] for k in ["mlx", *E]}
for rep in range(8):
    res["mlx"].append(mlx_run())
    for k, e in E.items(): res[k].append(eng_run(e))
m = statistics.median(res["mlx"])
for k, v in res.items():
    print(f"{name} {k:10s} {statistics.median(v):.3f} ms/step  mlx/this {m / statistics.median(v):.2f}  {[round(x, 2) for x in v]}")
