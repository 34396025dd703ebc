"""The confirmer protocol (analysis.confirmation): every confirmer is a Confirmer (prepare,
confirm, close) answering a typed Confirmation; a RootCause is built once and never
changed, its confirmation and first op kept beside it in the BisectReport. No engine: the
confirmers are built on stand-ins, the pair is the synthetic story pair."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from divergence.analysis.bisect import bisect_traces
from divergence.analysis.cause import BY_COMMAND, BY_REPLAY, ENVIRONMENT
from divergence.analysis.confirm import ReplayConfirmer
from divergence.analysis.confirm_command import CommandConfirmer
from divergence.analysis.confirmation import BaseConfirmer, ByKind, Confirmation, Confirmer
from divergence.analysis.environment_confirm import EnvironmentConfirmer
from divergence.analysis.pipeline import AnalysisOptions, analyze_pair
from divergence.analysis.report import render_bisect
from divergence.analysis.tp import TensorParallelConfirmer
from divergence.trace.reader import Trace

from tui import story  # noqa: E402  (tests/ is on sys.path)


class Recording(BaseConfirmer):
    """Confirms every cause it is asked about, and writes down what it was asked."""

    def __init__(self, by: str = BY_REPLAY):
        self.by, self.prepared, self.asked, self.closed = by, [], [], 0

    def prepare(self, pairs) -> None:
        self.prepared.append([(c.kind, rd.id) for c, rd in pairs])

    def confirm(self, cause, rd) -> Confirmation:
        self.asked.append(rd.id)
        return Confirmation(True, f"{rd.id} proved by {self.by}", self.by)

    def close(self) -> None:
        self.closed += 1


@pytest.fixture
def pair(tmp_path):
    pa, pb = story.write_pair(tmp_path)
    with Trace.open(pa) as a, Trace.open(pb) as b:
        yield a, b


def test_every_confirmer_is_a_confirmer(tmp_path):
    tp_side = SimpleNamespace(tp_degree=2, steps={"index": [0, 1]})
    one = SimpleNamespace(tp_degree=1)
    command = CommandConfirmer(None, None, "true {out}")
    environment = EnvironmentConfirmer(None, None)
    try:
        confirmers = [ReplayConfirmer(None, None, None), TensorParallelConfirmer(one, tp_side, None), command,
                      environment, ByKind(command, {ENVIRONMENT: environment}), Recording()]
        for c in confirmers:
            assert isinstance(c, Confirmer), type(c).__name__
    finally:
        command.close()
        environment.close()
    # a closure is no Confirmer: the contract is the protocol's three methods
    assert not isinstance(lambda cause, rd: (True, ""), Confirmer)


def test_a_root_cause_cannot_be_changed_and_its_confirmation_lives_beside_it(pair):
    a, b = pair
    confirmer = Recording()
    rep = bisect_traces(a, b, confirm=True, confirmer=confirmer)
    cause = rep.causes["r1"]
    before = cause.to_json()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cause.kind = ENVIRONMENT
    with pytest.raises(dataclasses.FrozenInstanceError):
        cause.confirmed = True  # no such field: a confirmation is not written into the cause
    assert not hasattr(cause, "confirmed") and not hasattr(cause, "first_op")
    assert cause.to_json() == before and before["confirm_detail"] == "" and before["confirmed_by"] is None
    # bisect prepared the confirmer once with every cause, then asked for each; the caller closes it
    assert confirmer.prepared == [[(c.kind, rid) for rid, c in rep.causes.items()]]
    assert confirmer.asked == list(rep.causes) and confirmer.closed == 0
    assert rep.confirmations["r1"] == Confirmation(True, "r1 proved by replay", BY_REPLAY)
    j = next(r for r in rep.to_json()["requests"] if r["id"] == "r1")
    assert (j["confirmed"], j["root_cause"]["confirm_detail"], j["root_cause"]["confirmed_by"]) == \
        (True, "r1 proved by replay", BY_REPLAY)
    assert "    confirmed: r1 proved by replay" in render_bisect(rep)
    assert rep.finding("r1").cause is cause and rep.finding("nobody") is None


def test_a_confirmation_that_ran_nothing_names_no_way():
    with pytest.raises(ValueError, match="cannot say how"):
        Confirmation(None, "nothing to force", BY_REPLAY)
    got = Confirmation(False, "refused before any replay")  # tried, but failed before saying how
    assert got.by is None and got.artifacts == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.confirmed = True


def test_by_kind_routes_each_cause_and_closes_every_confirmer(pair):
    a, b = pair
    default, env = Recording(), Recording(BY_COMMAND)
    rep = bisect_traces(a, b)
    cause = rep.causes["r1"]
    rd = next(r for r in rep.diff.requests if r.id == "r1")
    env_cause = dataclasses.replace(cause, kind=ENVIRONMENT, env_diff={"blas_core": ("Haswell", "SkylakeX")})
    routed = ByKind(default, {ENVIRONMENT: env})
    routed.prepare([(cause, rd), (env_cause, rd)])
    assert default.prepared == [[(cause.kind, "r1")]] and env.prepared == [[(ENVIRONMENT, "r1")]]
    assert routed.confirm(env_cause, rd).by == BY_COMMAND and routed.confirm(cause, rd).by == BY_REPLAY
    routed.close()
    assert (default.closed, env.closed) == (1, 1)


def test_the_pipeline_closes_the_confirmer_it_built(pair, monkeypatch):
    import divergence.analysis.pipeline as pipeline

    built = []

    def command(a, b, template, label_a, label_b, keep=False):
        built.append(Recording(BY_COMMAND))
        return built[-1]

    monkeypatch.setattr(pipeline, "CommandConfirmer", command)
    a, b = pair
    rep = analyze_pair(a, b, AnalysisOptions(confirm_cmd="rerun {trace} {out}"))
    assert built and built[0].closed == 1 and built[0].asked == list(rep.causes)
    assert all(c.by == BY_COMMAND and c.confirmed for c in rep.confirmations.values())
