"""Independent reference, logits too: under `native` at B=1 the engine's recorded top-k
logits are bit for bit the logits mlx-lm's own model gives on its own KVCache.

bf16: exactly generate_step's calls (the prompt but its last token in one call, then
one token per call). fp32 with OpenBLAS: SDPA over several query rows does not give the
last row's bits of a 1-query call, and the engine computes the last prompt token
inside its prefill, so there the reference is mlx-lm's model on the whole prompt in
one call, then one token per call (every later step is the same shape on both sides).
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from divergence.core.request import Request
from divergence.engine.engine import Engine

N = 12


def mlx_lm_logits(model, prompt, n, *, split_last: bool):
    cache = make_prompt_cache(model)
    rows = []
    if split_last:  # as generate_step
        model(mx.array(prompt[:-1])[None], cache=cache)
        y = prompt[-1]
    else:
        rows.append(np.array(model(mx.array(prompt)[None], cache=cache)[0, -1].astype(mx.float32)))
        y = int(np.argmax(rows[-1]))
    while len(rows) < n:
        row = np.array(model(mx.array([[y]]), cache=cache)[0, -1].astype(mx.float32))
        rows.append(row)
        y = int(np.argmax(row))
    return rows


@pytest.mark.parametrize("dtype", [None, "float32"])
def test_topk_logits_equal_mlx_lm_bitwise(target, prompts, dtype):
    from divergence.engine.model import load_model
    from divergence.fixtures import TARGET

    loaded = target if dtype is None else load_model(TARGET, dtype=dtype)
    eng = Engine(loaded, policy="native", stop_at_eos=False, top_k=8)
    reqs = [Request(f"r{i}", tuple(loaded.encode(p)), max_tokens=N) for i, p in enumerate(prompts[:3])]
    res = eng.run(reqs, "serial")
    for r in reqs:
        out = res.outputs[r.id]
        ref = mlx_lm_logits(loaded.model, list(r.prompt_tokens), N, split_last=dtype is None)
        assert out.tokens == [int(np.argmax(x)) for x in ref]
        for i, (ids, vals) in enumerate(zip(out.topk_ids, out.topk_logits)):
            ids, vals = np.asarray(ids), np.asarray(vals, np.float32)
            assert np.array_equal(ref[i][ids].view(np.uint32), vals.view(np.uint32)), (r.id, i, len(r.prompt_tokens))
            rest = np.delete(ref[i], ids)
            assert rest.max() <= vals.min(), (r.id, i)  # and they are the top k
