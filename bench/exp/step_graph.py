"""Experiment (issue 13, round 5): what a decode step costs on each side, and why.
1. graph nodes per decode step (primitive histogram), engine vs mlx-lm, B=1 and B=8
2. per-step time split for mlx-lm too (build / async_eval / rest), and engine variants
"""
import io, sys, time, json, os, statistics
from collections import Counter
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import common as C
from common import mx
import mlx.core as mxc
from mlx_lm.generate import BatchGenerator, generate_step
import divergence.engine.run as E
import divergence.engine.sampling as S
from divergence.engine.engine import Engine
from divergence.core.request import Request

model = sys.argv[1] if len(sys.argv) > 1 else "qwen0.5b"
cache = sys.argv[2] if len(sys.argv) > 2 else None
tp, _, _ = C.fixture_paths()
path = C.model_path(model, tp, cache)
t = C.load(path, os.environ.get("DTYPE", "bfloat16") if "4bit" not in model else None)
ps = C.prompts(t.encode, 8, 16)
out = {}

def hist(arrays):
    f = io.StringIO(); mxc.export_to_dot(f, *arrays)
    c = Counter()
    for line in f.getvalue().splitlines():
        if "[label =" in line:
            c[line.split('label ="')[1].split('"')[0]] += 1
    return c

class Capture:
    def __init__(self, at): self.at, self.n, self.hist = at, 0, None
    def __enter__(self):
        self.orig = mxc.async_eval
        def f(*arrays):
            self.n += 1
            if self.n == self.at:
                self.hist = hist(arrays)
            mxc.eval(*arrays)
        mxc.async_eval = f; E.mx.async_eval = f
        return self
    def __exit__(self, *e):
        mxc.async_eval = self.orig; E.mx.async_eval = self.orig

eng = Engine(t, policy="native", stop_at_eos=False)
eng.run([Request("w", tuple(ps[0][:8]), max_tokens=2)], "serial")
for B in (1, 8):
    with Capture(6) as cap:
        eng.run([Request(f"r{i}", tuple(p), max_tokens=10) for i, p in enumerate(ps[:B])], "concurrent")
    he = cap.hist
    with Capture(6) as cap:
        if B == 1:
            for _ in zip(range(10), generate_step(mx.array(ps[0]), t.model, max_tokens=10)):
                pass
        else:
            g = BatchGenerator(t.model, max_tokens=10, completion_batch_size=32, prefill_batch_size=8)
            g.insert([list(p) for p in ps[:B]], [10] * B)
            while g.next_generated():
                pass
            g.close()
    hm = cap.hist
    out[f"nodes_B{B}"] = {"engine": sum(he.values()), "mlx": sum(hm.values()), "engine_hist": dict(he.most_common()),
                          "mlx_hist": dict(hm.most_common())}
    print(f"B={B}: nodes engine {sum(he.values())} mlx-lm {sum(hm.values())}")
    keys = sorted(set(he) | set(hm), key=lambda k: -(he[k] + hm[k]))
    for k in keys:
        if he[k] != hm[k] or os.environ.get("ALL"):
            print(f"   {k:28s} engine {he[k]:5d}  mlx {hm[k]:5d}")

# timing: async_eval time on the mlx-lm side
def timed_mlx(B, n=24):
    qs = []
    orig = mxc.async_eval
    def f(*a):
        t0 = time.perf_counter(); orig(*a); qs.append(time.perf_counter() - t0)
    mxc.async_eval = f
    stamps = []
    try:
        if B == 1:
            for _ in generate_step(mx.array(ps[0]), t.model, max_tokens=n):
                stamps.append(time.perf_counter())
        else:
            g = BatchGenerator(t.model, max_tokens=n, completion_batch_size=32, prefill_batch_size=8)
            g.insert([list(p) for p in ps[:B]], [n] * B)
            while g.next_generated():
                stamps.append(time.perf_counter())
            g.close()
    finally:
        mxc.async_eval = orig
    iv = [b - a for a, b in zip(stamps, stamps[1:])]
    return statistics.median(iv) * 1e3, statistics.median(qs[2:]) * 1e3

def timed_engine(B, n=24, **kw):
    e = Engine(t, policy="native", stop_at_eos=False, **kw)
    e.run([Request("w", tuple(ps[0][:8]), max_tokens=2)], "serial")
    stamps = []
    class Obs(C.Observer):
        def on_token(self, ev): stamps.append((time.perf_counter(), ev.step))
    e.observers.append(Obs())
    e.run([Request(f"r{i}", tuple(p), max_tokens=n) for i, p in enumerate(ps[:B])], "concurrent")
    steps = sorted({s: t for t, s in stamps}.items())
    iv = [b[1] - a[1] for a, b in zip(steps, steps[1:])]
    return statistics.median(iv) * 1e3

for B in (1, 8):
    rows = []
    for rep in range(4):
        m_ms, m_q = timed_mlx(B)
        e_ms = timed_engine(B)
        e1_ms = timed_engine(B, top_k=1)
        rows.append((m_ms, m_q, e_ms, e1_ms))
    med = [statistics.median(r[i] for r in rows) for i in range(4)]
    out[f"time_B{B}"] = dict(mlx_ms=med[0], mlx_async_eval_ms=med[1], engine_ms=med[2], engine_topk1_ms=med[3])
    print(f"B={B}: mlx-lm {med[0]:.2f} ms/step (async_eval {med[1]:.2f}); engine {med[2]:.2f}; engine top_k=1 {med[3]:.2f}")
json.dump(out, open(os.environ.get("OUTJ", "/tmp/step_graph.json"), "w"), indent=1)
