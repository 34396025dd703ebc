"""Speculative decoding is lossless, matches mlx-lm, samples the target's distribution."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import speculative_generate_step

from divergence.engine import sampling as smp
from divergence.engine.engine import Engine
from divergence.core.events import Observer
from divergence.core.request import Request, Sampling
from divergence.engine.speculative import Proposal, accept_sampled


def reqs_for(target, prompts, n=32):
    return [Request(f"r{i}", tuple(target.encode(p)), max_tokens=n, arrival=i) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
def test_lossless_under_batch_invariant(target, draft, prompts, k):
    reqs = reqs_for(target, prompts[:4])
    plain = Engine(target, policy="batch-invariant", stop_at_eos=False).run(reqs, "serial")
    spec = Engine(target, draft, policy="batch-invariant", spec_k=k, stop_at_eos=False)
    for schedule in ("serial", "concurrent"):
        got = spec.run(reqs, schedule)
        for r in reqs:
            assert got.outputs[r.id].tokens == plain.outputs[r.id].tokens, (schedule, r.id)
        assert sum(o.accepted for o in got.outputs.values()) > 0, "the draft never got a token accepted"


@pytest.mark.parametrize("k", [2, 4])
def test_b1_matches_mlx_lm_speculative_generate_step(target, draft, prompts, k):
    eng = Engine(target, draft, policy="native", spec_k=k, stop_at_eos=False)
    for i, p in enumerate(prompts[:4]):
        toks = tuple(target.encode(p))
        got = eng.run([Request("r", toks, max_tokens=32)], "serial").outputs["r"]
        ref = [int(t) for t, _, _ in speculative_generate_step(
            mx.array(toks), target.model, draft.model, num_draft_tokens=k, max_tokens=32)]
        assert got.tokens == ref, f"prompt {i}"


class Tokens(Observer):
    def __init__(self):
        self.events = []

    def on_token(self, e):
        self.events.append(e)


def test_all_rejected_proposals_leave_no_stale_state(target, random_model, prompts):
    """A draft that never agrees: every verify rolls back k rows, yet the tokens are
    exactly plain decoding's (batch-invariant)."""
    bad_draft = random_model("llama", hidden_size=32, num_layers=1, seed=3)
    reqs = reqs_for(target, prompts[:3], n=24)
    plain = Engine(target, policy="batch-invariant", stop_at_eos=False).run(reqs, "concurrent")
    obs = Tokens()
    spec = Engine(target, bad_draft, policy="batch-invariant", spec_k=4, stop_at_eos=False, observers=[obs])
    got = spec.run(reqs, "concurrent")
    for r in reqs:
        assert got.outputs[r.id].tokens == plain.outputs[r.id].tokens
    rate = sum(o.accepted for o in got.outputs.values()) / sum(o.proposed for o in got.outputs.values())
    assert rate < 0.1, f"the random draft agreed too often ({rate:.0%}) for this test to mean anything"


def test_rejection_sampling_follows_the_target_distribution():
    """Chi-square over many seeded draws: accepted tokens follow p, not q.
    Threshold: chi2 critical value at p=0.001 for 5 degrees of freedom is 20.52."""
    rng = np.random.default_rng(0)
    vocab = 6
    p_logits = np.log(np.array([0.35, 0.25, 0.15, 0.12, 0.08, 0.05]))
    q = np.array([0.05, 0.10, 0.15, 0.20, 0.25, 0.25])
    n = 20000
    counts = np.zeros(vocab)
    for seed in range(n):
        s = Sampling(temperature=1.0, seed=seed)
        d = smp.draw(q, rng.random())
        prop = Proposal([d], [q])
        _, toks = accept_sampled(prop, np.stack([p_logits, p_logits]).astype(np.float32), s, 10)
        counts[toks[0]] += 1
    p = np.exp(p_logits)
    expected = p * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.52, (chi2, counts / n)
    chi2_q = float(((counts - q * n) ** 2 / (q * n)).sum())
    assert chi2_q > 1000  # and it is clearly not the draft's distribution


def test_a_sampling_request_prefilled_in_a_greedy_round(target, draft, prompts):
    """Regression: with every decoding sequence greedy, a round is queued without host syncs,
    and its verify step had asked for no full logits, yet a request that samples could be
    prefilling in that very step (arriving later): KeyError on its logit row. Under
    batch-invariant the greedy requests keep plain decoding's tokens, and the sampling one
    draws the same tokens in either schedule (its draws are keyed by seed and position;
    rejection sampling keeps the distribution, not plain sampling's very draws)."""
    reqs = [Request("g0", tuple(target.encode(prompts[0])), max_tokens=20),
            Request("g1", tuple(target.encode(prompts[1])), max_tokens=20),
            Request("s", tuple(target.encode(prompts[2])), max_tokens=12, arrival=3,
                    sampling=Sampling(temperature=0.8, seed=5))]
    plain = Engine(target, policy="batch-invariant", stop_at_eos=False).run(reqs, "serial")
    spec = Engine(target, draft, policy="batch-invariant", spec_k=3, stop_at_eos=False)
    runs = {schedule: spec.run(reqs, schedule) for schedule in ("concurrent", "serial")}
    for got in runs.values():
        assert [got.outputs[g].tokens for g in ("g0", "g1")] == [plain.outputs[g].tokens for g in ("g0", "g1")]
    assert len(runs["serial"].outputs["s"].tokens) == 12
    assert runs["concurrent"].outputs["s"].tokens == runs["serial"].outputs["s"].tokens
