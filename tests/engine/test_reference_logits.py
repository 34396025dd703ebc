"""Independent reference, logits too: under `native` at B=1 the engine's recorded top-k
logits are bit for bit the logits mlx-lm's own model gives on its own KVCache.

bf16: exactly generate_step's calls (the prompt but its last token in one call, then
one token per call). fp32 with OpenBLAS: SDPA over several query rows does not give the
last row's bits of a 1-query call, and the engine computes the last prompt token
inside its prefill, so there the reference is mlx-lm's model on the whole prompt in
one call, then one token per call (every later step is the same shape on both sides).
The reference's tokens are generate_step's greedy rule (argmax of logits - logsumexp in
the model dtype), which in bf16 is not always the argmax of the logits: small random
models meet those log-prob ties within 24 tokens, and the engine must take mlx-lm's token.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from divergence.core.request import Request
from divergence.engine.engine import Engine

pytestmark = pytest.mark.blas  # fp32 bits against mlx-lm's on whatever kernels this BLAS core picks

N = 12


class Reference(list):
    """mlx-lm's float32-widened logit rows, one per generated token, and `.tokens`: its
    greedy picks."""

    tokens: list[int]


def mlx_lm_logits(model, prompt, n, *, split_last: bool) -> Reference:
    """mlx-lm's model on its own KVCache, greedy by generate_step's own rule: the argmax of
    logits - logsumexp(logits) in the model dtype (in bf16 two logits that differ can round
    to one log-prob, and then the lower id wins: the argmax of the logits alone is not
    mlx-lm's token there)."""
    cache = make_prompt_cache(model)
    rows = Reference()
    rows.tokens = []

    def take(logits):  # [vocab] in the model dtype
        rows.append(np.array(logits.astype(mx.float32)))
        rows.tokens.append(int(mx.argmax(logits - mx.logsumexp(logits, keepdims=True)).item()))
        return rows.tokens[-1]

    if split_last:  # as generate_step
        model(mx.array(prompt[:-1])[None], cache=cache)
        y = prompt[-1]
    else:
        y = take(model(mx.array(prompt)[None], cache=cache)[0, -1])
    while len(rows) < n:
        y = take(model(mx.array([[y]]), cache=cache)[0, -1])
    return rows


@pytest.mark.parametrize("dtype", [None, "float32"])
def test_topk_logits_equal_mlx_lm_bitwise(target, prompts, dtype):
    from divergence.engine.model.loading import load_model
    from divergence.fixtures import TARGET

    loaded = target if dtype is None else load_model(TARGET, dtype=dtype)
    eng = Engine(loaded, policy="native", stop_at_eos=False, top_k=8)
    reqs = [Request(f"r{i}", tuple(loaded.encode(p)), max_tokens=N) for i, p in enumerate(prompts[:3])]
    res = eng.run(reqs, "serial")
    for r in reqs:
        out = res.outputs[r.id]
        ref = mlx_lm_logits(loaded.model, list(r.prompt_tokens), N, split_last=dtype is None)
        assert out.tokens == ref.tokens
        for i, (ids, vals) in enumerate(zip(out.topk_ids, out.topk_logits)):
            ids, vals = np.asarray(ids), np.asarray(vals, np.float32)
            assert np.array_equal(ref[i][ids].view(np.uint32), vals.view(np.uint32)), (r.id, i, len(r.prompt_tokens))
            rest = np.delete(ref[i], ids)
            assert rest.max() <= vals.min(), (r.id, i)  # and they are the top k


# bf16 models small enough that greedy decoding meets log-prob near-ties: logits that
# differ but round to one bf16 log-prob, where mlx-lm's rule takes the lower id
TIE_PROMPTS = ("def fibonacci(n):", "The quick brown fox jumps over the lazy dog and then", "import numpy as np\nx =")
NEAR_TIE_MODELS = {
    "llama hd16 GQA": ("llama", {}),
    "mistral untied": ("mistral", {"tie": False}),
    "llama MQA": ("llama", {"hidden_size": 96, "heads": 6, "kv_heads": 1, "num_layers": 1,
                            "intermediate_size": 200}),
    "qwen3 head_dim 32": ("qwen3", {"heads": 4, "kv_heads": 4, "extra_config": {"head_dim": 32}}),
}


@pytest.mark.parametrize("prefill", ["whole", "mlx-lm"])
@pytest.mark.parametrize("name", list(NEAR_TIE_MODELS))
def test_bf16_greedy_takes_mlx_lms_token_at_log_prob_ties(random_model, prompts, name, prefill):
    """The engine's greedy token is mlx-lm's (argmax of logits - logsumexp in bf16) where
    that is not the argmax of the logits, and its top-k logits stay bit for bit."""
    family, kw = NEAR_TIE_MODELS[name]
    loaded = random_model(family, **kw)
    eng = Engine(loaded, policy="native", stop_at_eos=False, top_k=8, prefill=prefill)
    texts = list(TIE_PROMPTS) + prompts[:2]
    reqs = [Request(f"r{i}", tuple(loaded.encode(p)), max_tokens=24) for i, p in enumerate(texts)]
    res = eng.run(reqs, "serial")
    ties = 0
    for r in reqs:
        out = res.outputs[r.id]
        ref = mlx_lm_logits(loaded.model, list(r.prompt_tokens), 24, split_last=prefill == "mlx-lm")
        assert out.tokens == ref.tokens, r.id
        ties += sum(int(np.argmax(row)) != t for row, t in zip(ref, ref.tokens))
        for i, (ids, vals) in enumerate(zip(out.topk_ids, out.topk_logits)):
            ids, vals = np.asarray(ids), np.asarray(vals, np.float32)
            assert np.array_equal(ref[i][ids].view(np.uint32), vals.view(np.uint32)), (r.id, i)
    assert ties, "no log-prob tie was met: the case this test is for"
