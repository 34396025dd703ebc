"""serve --spec-adaptive's draft length per round (speculative.AdaptiveDraft, spec_round's `spec_control`):
any mix of draft lengths, 0 included, keeps greedy tokens the target's own; the controller
picks the k that its measurements say gives the most tokens per second."""
from __future__ import annotations

import itertools

import httpx
import pytest

from divergence.core.names import DRAFT_MODEL
from divergence.core.events import Observer
from divergence.core.request import Request, Sampling
from divergence.engine.engine import Engine
from divergence.engine.run import Run
from divergence.engine.speculative import AdaptiveDraft

from .conftest import DRAFT, trace_of


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
    return Run(engine, requests, schedule, spec_control=control).execute()


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


class NoDrafts(Cycle):
    """A controller that never drafts and says so ahead (as AdaptiveDraft does mid-epoch)."""

    def __init__(self):
        super().__init__((0,))

    def next_k(self):
        return 0


def test_rounds_without_drafts_are_plain_decodes_queued_ahead(target, draft, prompts, monkeypatch):
    reqs = [Request(f"r{i}", tuple(target.encode(p)), max_tokens=12, arrival=0) for i, p in enumerate(prompts[:3])]
    plain = Engine(target, policy="batch-invariant", stop_at_eos=False).run(reqs, "concurrent")
    phases = []

    class Phases(Observer):
        def on_step(self, e):
            phases.append((e.plan.model, {sl.phase for sl in e.plan.slices}))

    spec = Engine(target, draft, policy="batch-invariant", spec_k=3, stop_at_eos=False, observers=[Phases()])
    ahead = []
    real = Run._launch_ahead
    monkeypatch.setattr(Run, "_launch_ahead", lambda self, *a: ahead.append(1) or real(self, *a))
    got = controlled_run(spec, reqs, "concurrent", NoDrafts())
    for r in reqs:
        assert got.outputs[r.id].tokens == plain.outputs[r.id].tokens, r.id
    assert DRAFT_MODEL not in {m for m, _ in phases}  # the draft never ran: nothing to catch up
    assert not any("verify" in p for _, p in phases), phases  # no verify of zero proposals
    assert len(ahead) >= 8  # decode steps were queued before the previous one returned


def test_the_controller_knows_the_next_k_only_inside_an_epoch():
    c = AdaptiveDraft(3, epoch=2, clock=iter(range(100)).__next__)
    seqs = [Seq("a", 5)]
    assert c.choose(seqs, {"a": 3}) == 3 and c.next_k() == 3
    c.choose(seqs, {"a": 3})
    assert c.next_k() is None  # the next choose closes the epoch: its k is not known yet


def test_a_sampling_request_runs_at_any_draft_length(target, draft, prompts):
    reqs = [Request("g", tuple(target.encode(prompts[0])), max_tokens=16),
            Request("s", tuple(target.encode(prompts[1])), max_tokens=16, arrival=2, sampling=Sampling(0.8, 0.9, 7))]
    spec = Engine(target, draft, spec_k=3, stop_at_eos=False)
    got = controlled_run(spec, reqs, "concurrent", Cycle())
    assert [len(got.outputs[r.id].tokens) for r in reqs] == [16, 16]


class Seq:
    def __init__(self, sid, n):
        self.id, self.tokens = sid, [0] * n


class World:
    """A fake server: rounds at k take seconds[k] and commit tokens[k] per sequence."""

    def __init__(self, seconds: dict[int, float], tokens: dict[int, int], n: int = 4):
        self.now, self.seconds, self.tokens = 0.0, seconds, tokens
        self.seqs = [Seq(f"b{n}-r{i}", 10) for i in range(n)]
        self.c = AdaptiveDraft(3, clock=lambda: self.now)

    def rounds(self, n: int) -> list[int]:
        picks = []
        for _ in range(n):
            k = self.c.choose(self.seqs, {s.id: 3 for s in self.seqs})
            picks.append(k)
            self.now += self.seconds[k]
            self.c.observe(k, self.seconds[k])
            for s in self.seqs:
                s.tokens += [0] * self.tokens[k]
        return picks


def test_an_expensive_draft_with_low_acceptance_is_turned_off():
    # the fixture pair on this CPU: a draft step ~0.7 of a verify, ~43% accepted (1, 1.43, 1.61, 1.69 tokens)
    w = World({0: 0.020, 1: 0.034, 2: 0.048, 3: 0.062}, {0: 1, 1: 1, 2: 2, 3: 2})
    picks = w.rounds(4 * w.c.epoch + 30 * w.c.epoch)
    late = picks[4 * w.c.epoch:]
    assert late.count(0) > 0.8 * len(late) and set(late) <= {0, 1}  # off, a neighbour tried now and then
    assert set(picks[: 4 * w.c.epoch]) == {0, 1, 2, 3}  # each length tried first


def test_a_cheap_draft_with_high_acceptance_proposes_the_most():
    w = World({0: 0.020, 1: 0.022, 2: 0.024, 3: 0.026}, {0: 1, 1: 2, 2: 3, 3: 4})
    late = w.rounds(40 * w.c.epoch)[4 * w.c.epoch:]
    assert late.count(3) > 0.8 * len(late)
    # ...but no more than a sequence may (near its max_tokens)
    assert w.c.choose(w.seqs, {s.id: 1 for s in w.seqs}) == 1


def test_an_idle_pause_is_not_counted_against_a_length():
    w = World({0: 0.020, 1: 0.022, 2: 0.024, 3: 0.026}, {0: 1, 1: 2, 2: 3, 3: 4})
    w.rounds(3)
    w.now += 30.0  # nobody sent anything for half a minute, in epoch k=3
    w.rounds(40 * w.c.epoch)
    assert max(w.c.rate, key=w.c.rate.get) == 3


def test_serve_spec_adaptive_records_it_and_says_what_it_chose(serve):
    s = serve("--draft", str(DRAFT), "--spec-adaptive", "--ignore-eos")
    with httpx.Client(timeout=120) as c:
        rs = [c.post(s.base_url + "/completions", json={"model": "target", "prompt": "The quick brown",
                                                          "max_tokens": 12}) for _ in range(3)]
    assert all(r.status_code == 200 for r in rs)
    assert s.stop() == 0
    [path] = s.traces()
    with trace_of(path) as t:
        assert t.meta["settings"]["serve"]["spec"] == "adaptive"
        assert {r.json()["id"] for r in rs} <= {q.id for q in t.requests}
    log = s.log.read_text()
    assert "divergence serve: draft tokens per round:" in log and "spec k=up to 3" in log
