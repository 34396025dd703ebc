"""B=1 decode on a GPU (issue 13, round 6): where the engine's extra host time goes.
Variants of the engine, interleaved with generate_step, median ms/step:
  default; top_k=1; no_topk (no top-k on the device, no token events); no_cache_roots
  (async_eval without the K/V pools as extra roots); no_overlap.
(Round 5's `exp_b1.py`, default and top_k=1 only, is folded in here.)
    python bench/exp/exp_b1_variants.py qwen0.5b-4bit /root/mc
"""
import contextlib, os, statistics, sys, time, types
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import common as C
from common import mx
from mlx_lm.generate import generate_step
import divergence.engine.run as R
import divergence.engine.sampling as S
from divergence.engine.engine import Engine
from divergence.core.request import Request

tp, _, _ = C.fixture_paths()
name = sys.argv[1]
t = C.load(C.model_path(name, tp, sys.argv[2] if len(sys.argv) > 2 else None), None if "4bit" in name else "bfloat16")
ps = C.prompts(t.encode, 8, 16)
N = int(os.environ.get("TOKENS", 48))


def eng_run(e, n=N):
    st = []

    class O(C.Observer):
        def on_step(self, ev): st.append(time.perf_counter())
    e.observers = [O()]
    e.run([Request("r", tuple(ps[0]), max_tokens=n)], "concurrent")
    e.observers = []
    return statistics.median([b - a for a, b in zip(st, st[1:])]) * 1e3


def mlx_run(n=N):
    st = []
    for _ in generate_step(mx.array(ps[0]), t.model, max_tokens=n):
        st.append(time.perf_counter())
    return statistics.median([b - a for a, b in zip(st, st[1:])]) * 1e3


@contextlib.contextmanager
def no_topk():
    sod, tev = S.sample_on_device, S.token_event

    def f(logits, **kw):
        kw["want_topk"] = False
        return sod(logits, **kw)
    S.sample_on_device = f
    S.token_event = lambda *a, **k: types.SimpleNamespace(topk_ids=None, topk_logits=None)
    try:
        yield
    finally:
        S.sample_on_device, S.token_event = sod, tev


@contextlib.contextmanager
def no_cache_roots():
    orig = R.ModelState.forward_step if hasattr(R, "ModelState") else None
    ae = R.mx.async_eval
    n_cache = {}

    def f(*arrays):
        return ae(*arrays[: max(1, len(arrays) - n_cache.get("n", 0))])
    from divergence.engine.model import kv_cache
    real = kv_cache.PagedKVCache.arrays

    def arrays(self):
        n_cache["n"] = len(self.k) * 2
        return real(self)
    kv_cache.PagedKVCache.arrays = arrays
    R.mx = types.SimpleNamespace(**{k: getattr(mx, k) for k in dir(mx) if not k.startswith("__")})
    R.mx.async_eval = f
    try:
        yield
    finally:
        kv_cache.PagedKVCache.arrays = real
        R.mx = mx


E = {"default": (Engine(t, policy="native", stop_at_eos=False), contextlib.nullcontext),
     "top_k=1": (Engine(t, policy="native", stop_at_eos=False, top_k=1), contextlib.nullcontext),
     "no_topk": (Engine(t, policy="native", stop_at_eos=False), no_topk),
     "no_cache_roots": (Engine(t, policy="native", stop_at_eos=False), no_cache_roots),
     "no_overlap": (Engine(t, policy="native", stop_at_eos=False, overlap=False), contextlib.nullcontext)}
for e, ctx in E.values():
    with ctx():
        eng_run(e, 4)
mlx_run(4)
res = {k: [] for k in ["mlx", *E]}
for rep in range(int(os.environ.get("REPS", 8))):
    res["mlx"].append(mlx_run())
    for k, (e, ctx) in E.items():
        with ctx():
            res[k].append(eng_run(e))
for k, v in res.items():
    ratio = statistics.median([m / x for m, x in zip(res["mlx"], v)])
    print(f"{name} {k:15s} {statistics.median(v):.3f} ms/step  mlx/this {ratio:.3f}  {[round(x, 2) for x in v]}")
