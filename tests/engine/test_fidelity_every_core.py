"""Under `native` at B=1 the engine gives mlx-lm's tokens and top-k logits bit for bit on
whatever kernels the backend picks: every family (dense, MoE, 4-bit), fp32 and bf16, both
prefill layouts. Marked `blas`: CI runs this module again under every OpenBLAS core the CPU
can run and under the reference BLAS (.ci/blas-cores), so a shortcut that is bit-safe on one
kernel family only (a prefill's logits for its last row alone, say) fails here on another.
The reference is mlx-lm's own model on its own KVCache (test_reference_logits.mlx_lm_logits):
the whole prompt in one call for `whole`, generate_step's two calls for `mlx-lm`."""
from __future__ import annotations

import numpy as np
import pytest

from divergence.engine.kernels.blas import blas_core, blas_in_use
from divergence.core.request import Request
from divergence.engine.engine import Engine
from test_reference_logits import mlx_lm_logits

pytestmark = pytest.mark.blas

# shapes big enough for OpenBLAS's small-matrix kernels and its threads to differ by row count
MODELS = {
    "llama fp32": ("llama", {"dtype": "float32", "hidden_size": 256, "intermediate_size": 512, "heads": 8,
                             "kv_heads": 4}),
    "qwen3 fp32 untied": ("qwen3", {"dtype": "float32", "hidden_size": 128, "heads": 4, "kv_heads": 2,
                                    "tie": False}),
    "mistral bf16": ("mistral", {"dtype": "bfloat16", "hidden_size": 256, "intermediate_size": 512, "heads": 8}),
    "mixtral fp32 (MoE)": ("mixtral", {"dtype": "float32", "hidden_size": 128, "num_experts": 4}),
    "llama 4-bit": ("llama", {"dtype": "bfloat16", "hidden_size": 256, "intermediate_size": 512, "heads": 8,
                              "quantize_bits": 4}),
}
N = 10


@pytest.mark.parametrize("prefill", ["whole", "mlx-lm"])
@pytest.mark.parametrize("name", list(MODELS))
def test_b1_tokens_and_topk_logits_equal_mlx_lm_on_this_backend(random_model, prompts, name, prefill):
    family, kw = MODELS[name]
    loaded = random_model(family, seed=5, **kw)
    eng = Engine(loaded, policy="native", stop_at_eos=False, top_k=8, prefill=prefill)
    # prompts of several lengths: a row's bits can depend on the whole product's row count
    texts = [prompts[0], prompts[3], " ".join(prompts[4:9])]
    reqs = [Request(f"r{i}", tuple(loaded.encode(p)), max_tokens=N) for i, p in enumerate(texts)]
    res = eng.run(reqs, "serial")
    where = f"{name}, prefill {prefill}, BLAS {blas_in_use()} core {blas_core()}"
    for r in reqs:
        out = res.outputs[r.id]
        ref = mlx_lm_logits(loaded.model, list(r.prompt_tokens), N, split_last=prefill == "mlx-lm")
        assert out.tokens == ref.tokens, (where, r.id)
        for i, (ids, vals) in enumerate(zip(out.topk_ids, out.topk_logits)):
            ids, vals = np.asarray(ids), np.asarray(vals, np.float32)
            assert np.array_equal(ref[i][ids].view(np.uint32), vals.view(np.uint32)), (where, r.id, i)
