"""Prefix caching and the `warm` schedule: cold vs warm as one more pair to compare."""
from __future__ import annotations

import pytest

from divergence.engine.engine import Engine
from divergence.core.events import Observer
from divergence.core.request import Request
from divergence.workloads.prompts import DEMO_R2_PROMPT


class Writes(Observer):
    wants_kv_hashes = True

    def __init__(self):
        self.kv, self.plans = [], []

    def on_kv_write(self, w):
        self.kv.append(w)

    def on_step(self, e):
        self.plans.append(e.plan)


def shared_prefix_requests(target, n=4, tokens=24):
    base = target.encode(DEMO_R2_PROMPT)
    return [Request(f"r{i}", tuple(base[: 40 + 9 * i]), max_tokens=tokens) for i in range(n)]


@pytest.mark.parametrize("prefill", ["whole", "mlx-lm"])
def test_warm_equals_cold_under_batch_invariant_and_frees_every_block(target, prefill):
    reqs = shared_prefix_requests(target)
    eng = Engine(target, policy="batch-invariant", stop_at_eos=False, prefill=prefill)
    cold, warm = eng.run(reqs, "serial"), eng.run(reqs, "warm")
    assert warm.prefix_hits >= 16 * len(reqs), "the warm run did not reuse cached blocks"
    for r in reqs:
        assert warm.outputs[r.id].tokens == cold.outputs[r.id].tokens
    assert sorted(warm.outputs) == sorted(r.id for r in reqs)  # the warm-up is not a result
    assert cold.blocks_in_use == 0 and warm.blocks_in_use == 0


@pytest.mark.parametrize("prefill", ["whole", "mlx-lm"])
def test_shared_prefix_reuse_in_concurrent(target, prefill):
    reqs = [Request(r.id, r.prompt_tokens, max_tokens=8, arrival=3 * i)
            for i, r in enumerate(shared_prefix_requests(target))]
    plain = Engine(target, policy="batch-invariant", stop_at_eos=False, prefill=prefill).run(reqs, "concurrent")
    cached = Engine(target, policy="batch-invariant", stop_at_eos=False, prefix_caching=True,
                    prefill=prefill).run(reqs, "concurrent")
    assert cached.prefix_hits > 0 and cached.blocks_in_use == 0
    assert all(cached.outputs[r.id].tokens == plain.outputs[r.id].tokens for r in reqs)


def test_warm_cache_divergence_comes_from_the_cached_blocks(target):
    """Under threshold:N the warm-up computes the shared prefix in one big batched step
    (gemm, other split-K) while cold serial computes it per request: the live K/V of the
    prefix positions differ, and they were written by a warm-up step."""
    reqs = shared_prefix_requests(target, tokens=32)
    cold_w, warm_w = Writes(), Writes()
    Engine(target, policy="threshold:1", stop_at_eos=False, observers=[cold_w]).run(reqs, "serial")
    Engine(target, policy="threshold:1", stop_at_eos=False, observers=[warm_w]).run(reqs, "warm")
    warmup_steps = {p.index for p in warm_w.plans if all(s.request_id.startswith("warmup/") for s in p.slices)}
    assert warmup_steps
    rid = reqs[-1].id

    def live(obs):
        cells = {}
        for w in obs.kv:
            if w.request_id == rid and w.layer == 0:
                for i in range(w.count):
                    cells[w.start + i] = (w.step, int(w.k_hashes[i]))
        return cells

    cold, warm = live(cold_w), live(warm_w)
    shared = [p for p in sorted(warm) if warm[p][0] in warmup_steps]
    assert len(shared) >= 16, "the warm request read no cached block"
    differing = [p for p in shared if warm[p][1] != cold[p][1]]
    assert differing, "the cached prefix K/V equal the cold ones: nothing to see"
