"""The serve's draft length per round (speculative.AdaptiveDraft, spec_round's `spec_control`):
any mix of draft lengths, 0 included, keeps greedy tokens the target's own; the controller
picks the k that its measurements say gives the most tokens per second."""
from __future__ import annotations

import itertools

import pytest

from divergence.core.names import DRAFT_MODEL
from divergence.core.events import Observer
from divergence.core.request import Request, Sampling
from divergence.engine.engine import Engine
from divergence.engine.run import Run
from divergence.engine.speculative import AdaptiveDraft


class Cycle:
    """A controller that proposes 0, 3, 1, 0, 2, ... draft tokens, whatever it measures."""

    def __init__(self, ks=(0, 3, 1, 0, 2)):
        self.ks, self.seen = itertools.cycle(ks), []

    def choose(self, seqs, caps):
        k = next(self.ks)
        self.seen.append(k)
        return k

    def observe(self, k, seconds):
        pass


class Steps(Observer):
    def __init__(self):
        self.models = []

    def on_step(self, e):
        self.models.append(e.plan.model)


def controlled_run(engine, requests, schedule, control):
    run = Run(engine, requests, schedule)
    run.spec_control = control
    return run.execute()


@pytest.mark.parametrize("schedule", ["serial", "concurrent"])
def test_any_draft_lengths_keep_the_targets_greedy_tokens(target, draft, prompts, schedule):
    reqs = [Request(f"r{i}", tuple(target.encode(p)), max_tokens=24, arrival=i) for i, p in enumerate(prompts[:4])]
    plain = Engine(target, policy="batch-invariant", stop_at_eos=False).run(reqs, "serial")
    steps = Steps()
    spec = Engine(target, draft, policy="batch-invariant", spec_k=3, stop_at_eos=False, observers=[steps])
    control = Cycle()
    got = controlled_run(spec, reqs, schedule, control)
    for r in reqs:
        assert got.outputs[r.id].tokens == plain.outputs[r.id].tokens, r.id
    assert {0, 1, 2, 3} <= set(control.seen)
    assert DRAFT_MODEL in steps.models
    assert sum(o.accepted for o in got.outputs.values()) > 0


def test_a_sampling_request_runs_at_any_draft_length(target, draft, prompts):
    reqs = [Request("g", tuple(target.encode(prompts[0])), max_tokens=16),
            Request("s", tuple(target.encode(prompts[1])), max_tokens=16, arrival=2, sampling=Sampling(0.8, 0.9, 7))]
    spec = Engine(target, draft, spec_k=3, stop_at_eos=False)
    got = controlled_run(spec, reqs, "concurrent", Cycle())
    assert [len(got.outputs[r.id].tokens) for r in reqs] == [16, 16]


class Seq:
    def __init__(self, sid, proposed, accepted):
        self.id, self.proposed, self.accepted = sid, proposed, accepted


def taught(times: dict[int, float], accept: float, n: int = 4) -> tuple[AdaptiveDraft, list[Seq]]:
    c = AdaptiveDraft(3)
    for k, t in times.items():
        c.observe(k, t)
    seqs = [Seq(f"r{i}", 100, int(100 * accept)) for i in range(n)]
    return c, seqs


def test_an_expensive_draft_with_low_acceptance_is_not_used():
    # the fixture pair on this CPU: a draft step ~0.7 of a verify, ~43% accepted
    c, seqs = taught({0: 0.020, 1: 0.034}, 0.43)
    assert c.choose(seqs, {s.id: 3 for s in seqs}) == 0


def test_a_cheap_draft_with_high_acceptance_proposes_the_most():
    c, seqs = taught({0: 0.020, 1: 0.022}, 0.9)
    assert c.choose(seqs, {s.id: 3 for s in seqs}) == 3
    # ...but no more than a sequence may (near its max_tokens)
    assert c.choose(seqs, {s.id: 1 for s in seqs}) == 1


def test_it_starts_speculating_and_explores_a_neighbour():
    c = AdaptiveDraft(3)
    seqs = [Seq("r0", 0, 0)]
    assert c.choose(seqs, {"r0": 3}) >= 1  # before any measure: the prior says a draft pays
    c.observe(0, 0.02)
    c.observe(1, 0.04)
    picks = [c.choose([Seq("r0", 50, 20)], {"r0": 3}) for _ in range(2 * c.explore_every)]
    assert picks.count(0) > len(picks) * 0.8 and set(picks) - {0}  # mostly 0, a neighbour now and then
