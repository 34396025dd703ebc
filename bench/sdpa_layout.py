"""Why the engine lays K/V out as mlx-lm's KVCache does before a one-row SDPA on MLX CUDA
(attention.mlxlm_reads), measured: run on the GPU, it prints

1. per prompt length, for 6 greedy steps at B=1 under `native`, whether the engine's top-k
   logits equal the logits of mlx-lm's own model call over its KVCache ("=") or by how much
   they differ;
2. whether `mx.fast.scaled_dot_product_attention` gives the same numbers for the same K/V
   as a slice of a 256-step buffer (mlx-lm's), as a contiguous array, and as a slice of a
   long pool (the engine's paged cache), for one-row, 7-row and causal queries.

    python bench/sdpa_layout.py qwen0.5b bfloat16      # the output: bench/results/cuda/layout_*.txt
"""
import os
import sys
sys.path.insert(0, "bench")
import common as C
from common import mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from divergence.engine.engine import Engine
from divergence.core.request import Request
name = sys.argv[1]; dtype = sys.argv[2] if len(sys.argv) > 2 else None
target, _, _ = C.fixture_paths()
path = C.model_path(name, target, os.path.expanduser("~/mc"))
t = C.load(path, None if dtype == "stored" else dtype)
eng = Engine(t, policy="native", stop_at_eos=False, token_budget=4096, prefill="mlx-lm")
m = t.model
for ctx in (128, 200, 250, 254, 255, 256, 257, 258, 300, 511, 512, 513, 1020):
    p = C.prompts(t.encode, 1, ctx)[0]
    out = eng.run([Request("r", tuple(p), max_tokens=6)], "serial").outputs["r"]
    cache = make_prompt_cache(m)
    m(mx.array(p[:-1])[None], cache=cache)
    x = p[-1]
    res = []
    for i, tok in enumerate(out.tokens):
        lg = m(mx.array([[x]]), cache=cache)[0, -1].astype(mx.float32)
        ref = np.array(lg)[out.topk_ids[i]]
        res.append("=" if np.array_equal(ref, out.topk_logits[i]) else f"x{np.abs(ref - out.topk_logits[i]).max():.3g}")
        x = tok
    print(ctx, " ".join(res), flush=True)

# does MLX's SDPA give other numbers for keys sliced from a longer buffer (mlx-lm's KVCache)
# than for the same keys contiguous (a gathered paged cache)?
mx.random.seed(0)
for L in (128, 200, 255, 256, 257, 300, 511, 512, 513, 1024, 1500):
    buf_k = mx.random.normal((1, 2, ((L + 255) // 256) * 256, 64)).astype(mx.bfloat16)
    buf_v = mx.random.normal(buf_k.shape).astype(mx.bfloat16)
    q = mx.random.normal((1, 14, 1, 64)).astype(mx.bfloat16)
    ks, vs = buf_k[:, :, :L], buf_v[:, :, :L]
    a = mx.fast.scaled_dot_product_attention(q, ks, vs, scale=0.125)
    b = mx.fast.scaled_dot_product_attention(q, mx.contiguous(ks), mx.contiguous(vs), scale=0.125)
    print("sdpa L", L, "buffer", buf_k.shape[2], "same" if mx.array_equal(a, b).item() else f"differ {mx.abs(a - b).max().item():.3g}", flush=True)

# does the stride's value matter, or only row-contiguity? and multi-row (causal prefill) queries?
for L in (300, 700, 1500, 3000):
    kc = mx.random.normal((1, 2, L, 64)).astype(mx.bfloat16)
    vc = mx.random.normal((1, 2, L, 64)).astype(mx.bfloat16)
    def view(x, n):
        return mx.pad(x, [(0, 0), (0, 0), (0, n - L), (0, 0)])[:, :, :L]
    buf = ((L + 255) // 256) * 256
    for qn in (1, 7, L):
        q = mx.random.normal((1, 14, qn, 64)).astype(mx.bfloat16)
        mask = "causal" if qn > 1 else None
        o_buf = mx.fast.scaled_dot_product_attention(q, view(kc, buf), view(vc, buf), scale=0.125, mask=mask)
        o_pool = mx.fast.scaled_dot_product_attention(q, view(kc, 8192), view(vc, 8192), scale=0.125, mask=mask)
        o_con = mx.fast.scaled_dot_product_attention(q, kc, vc, scale=0.125, mask=mask)
        print("L", L, "q", qn, "buffer-stride vs pool-stride", "same" if mx.array_equal(o_buf, o_pool).item() else "DIFFER",
              "| strided vs contiguous", "same" if mx.array_equal(o_buf, o_con).item() else "differ", flush=True)
