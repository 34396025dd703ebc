"""Routing records: what the trace says each MoE layer chose is what the engine
chose (exact round trip), and what mlx-lm's own block chose on the same prompt."""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from divergence.core.events import Observer
from divergence.core.request import Request
from divergence.engine.engine import Engine
from divergence.trace.reader import Trace
from divergence.trace.writer import TraceWriter

MOE = dict(hidden_size=64, num_layers=2, num_experts=8, experts_per_token=2, dtype="float32")


class Keep(Observer):
    wants_routing = True

    def __init__(self):
        self.events = []

    def on_routing(self, r):
        self.events.append(r)


def test_routing_round_trips_through_the_trace(random_model, prompts, tmp_path):
    loaded = random_model("qwen3_moe", **MOE)
    keep = Keep()
    path = tmp_path / "c.h5"
    reqs = [Request(f"r{i}", tuple(loaded.encode(p)), max_tokens=6) for i, p in enumerate(prompts[:3])]
    with TraceWriter(path) as w:
        Engine(loaded, policy="native", stop_at_eos=False, observers=[w, keep]).run(reqs, "concurrent")
    with Trace.open(path) as t:
        assert t.has_routing
        for r in reqs:
            got = t.routing(r.id)
            evs = [e for e in keep.events if e.request_id == r.id]
            n = len(r.prompt_tokens) + 5  # the last token is sampled, never fed back
            assert len(got["position"]) == 2 * n  # every prompt and fed-back token, both layers
            for e in evs:
                for i in range(e.count):
                    j = np.flatnonzero((got["layer"] == e.layer) & (got["position"] == e.start + i))
                    assert j.size == 1
                    j = int(j[0])
                    assert got["step"][j] == e.step
                    assert list(got["experts"][j]) == list(e.experts[i])
                    assert got["scores"][j].view(np.uint32).tolist() == e.scores[i].view(np.uint32).tolist()
                    assert got["runner_up"][j] == e.runner_up[i] and got["input_hash"][j] == e.input_hash[i]
            # the runner-up is not chosen, and ranks below every chosen expert
            assert not (got["experts"] == got["runner_up"][:, None]).any()
            assert (got["scores"].min(axis=1) >= got["runner_up_score"]).all()


def test_recorded_experts_are_mlx_lms_choice(random_model, prompts):
    """Independent: wrap mlx-lm's own SwitchGLU and run mlx-lm's model on the prompt."""
    loaded = random_model("mixtral", **MOE)
    keep = Keep()
    prompt = tuple(loaded.encode(prompts[1]))
    Engine(loaded, policy="native", stop_at_eos=False, observers=[keep]).run(
        [Request("r", prompt, max_tokens=1)], "serial")
    seen = {}
    for li, layer in enumerate(loaded.model.layers):
        sw = layer.block_sparse_moe.switch_mlp
        orig = type(sw).__call__

        def spy(self, x, indices, _li=li, _orig=orig):
            seen[_li] = np.array(indices)
            return _orig(self, x, indices)

        layer.block_sparse_moe.switch_mlp = _Spy(sw, spy)
    try:
        mx.eval(loaded.model(mx.array(prompt)[None]))
    finally:
        for layer in loaded.model.layers:
            layer.block_sparse_moe.switch_mlp = layer.block_sparse_moe.switch_mlp.inner
    for e in keep.events:
        assert e.start == 0 and e.count == len(prompt)
        assert np.array_equal(e.experts, seen[e.layer][0]), e.layer


class _Spy:
    def __init__(self, inner, fn):
        self.inner, self.fn = inner, fn

    def __call__(self, x, indices):
        return self.fn(self.inner, x, indices)
