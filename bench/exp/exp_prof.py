"""cProfile of engine decode steps' host side vs mlx-lm generate_step (B=1 and B=8), plus op micro-costs."""
import cProfile, pstats, io, os, sys, time, statistics
import numpy as np
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import common as C
from common import mx
from mlx_lm.generate import generate_step, BatchGenerator
from divergence.engine.engine import Engine
from divergence.core.request import Request
tp, _, _ = C.fixture_paths()
path = C.qwen_path(tp, sys.argv[1] if len(sys.argv) > 1 else None)
t = C.load(path, "bfloat16")
ps = C.prompts(t.encode, 8, 16)
def bench(name, f, n=2000):
    f(); t0 = time.perf_counter()
    for _ in range(n): f()
    print(f"  {name:34s} {(time.perf_counter()-t0)/n*1e6:7.2f} us")
a = np.arange(8, dtype=np.int32)
bench("mx.array(np int32[8])", lambda: mx.array(a))
bench("mx.array(list[8])", lambda: mx.array([1,2,3,4,5,6,7,8], dtype=mx.int32))
x = mx.zeros((8, 896), dtype=mx.bfloat16); mx.eval(x)
bench("x + x", lambda: x + x)
bench("x[0:4]", lambda: x[0:4])
bench("rms_norm", lambda: mx.fast.rms_norm(x, x[0], 1e-6))
r = mx.zeros((8, 14, 1, 64), dtype=mx.bfloat16); mx.eval(r)
bench("rope", lambda: mx.fast.rope(r, 64, traditional=False, base=1e6, scale=1.0, offset=5))
eng = Engine(t, policy="native", stop_at_eos=False)
eng.run([Request("w", tuple(ps[0][:8]), max_tokens=2)], "serial")
for B in (1, 8):
    pr = cProfile.Profile()
    pr.enable()
    eng.run([Request(f"r{i}", tuple(p), max_tokens=40) for i, p in enumerate(ps[:B])], "concurrent")
    pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30); print(f"== engine B={B}\n" + s.getvalue()[:6000])
pr = cProfile.Profile(); pr.enable()
for _ in zip(range(40), generate_step(mx.array(ps[0]), t.model, max_tokens=40)):
    pass
pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25); print("== mlx-lm B=1\n" + s.getvalue()[:5000])
