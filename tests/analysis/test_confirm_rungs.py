"""Each rung of a replay confirmation (analysis.confirm) alone, on a stand-in for its Case:
what it forces, when it does not apply, its typed result (confirmed, sentence, forcing,
replays, how) and the order ReplayConfirmer climbs them in. No engine, no traces."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from divergence.analysis import confirm as C
from divergence.analysis.bisect import bisect_traces
from divergence.analysis.cause import BY_REPLAY, BY_REPLAY_PREFILL, BY_REPLAY_SOLO, ReplayBisection
from divergence.analysis.confirm import confirmer
from divergence.analysis.confirmation import Confirmation
from divergence.analysis.forcing import forcing_words
from divergence.core.policy import SOLO, RelayoutStep


class FakeCase:
    """Stands in for confirm.Case: `fixes(forced)` says whether B replayed with that forcing
    matches A; `kernels` whether the cause's step has A's kernels to force (else SOLO)."""

    label_a, label_b = "A", "B"

    def __init__(self, fixes, *, pairs=None, passes=None, kernels=True, story=None):
        self.fixes, self.kernels = fixes, kernels
        self.cause = SimpleNamespace(a=SimpleNamespace(step=4), b=SimpleNamespace(step=5), positions=[9], layer=0,
                                     sampler=story, kind="cache_contamination", model="target")
        self.rd = SimpleNamespace(id="r1", first_divergent_token=SimpleNamespace(step_b=9, position=12), prompt_len=10)
        self.goal = "makes r1 match A up to the divergence"
        self.pairs = pairs or {5: 4}
        self._passes = passes or {}
        self.replays = 0
        self.by_tried = None
        self.asked = []

    def force(self, step_a, step_b, positions=None, layer=None, *, alone=False):
        self.asked.append((step_a, step_b, alone))
        return SOLO if alone or not self.kernels else {"k_proj": f"A{step_a}"}

    def words(self, forced):
        return forcing_words(forced, "A")

    def full_because(self):  # every replay ran sparse (analysis/sparse.py)
        return None

    def where(self, i):
        return f"generated #{i}"

    def check(self, forced):
        self.replays += 1
        ok = self.fixes(forced)
        return ok, ", bit for bit" if ok else "", None if ok else 3

    def decision(self, forced, position, purpose, until):
        self.replays += 1
        return {"token": 7 if self.fixes(forced) else 8}

    def suspects(self):
        return self.pairs

    draw_suspects = suspects

    def passes(self):
        return self._passes


def test_rung_kernels_forces_the_cause_step_alone():
    case = FakeCase(lambda f: set(f) == {5})
    got = C.rung_kernels(case, [])
    assert (got.rung, got.confirmed, got.forced, got.replays, got.by) == ("kernels", True, {5: {"k_proj": "A4"}}, 1,
                                                                          BY_REPLAY)
    assert got.detail == "replaying B with step 5 run on A's kernels makes r1 match A up to the divergence, bit for bit"


def test_rung_kernels_on_native_steps_runs_the_step_solo_and_says_so():
    got = C.rung_kernels(FakeCase(lambda f: False, kernels=False), [])
    assert (got.confirmed, got.forced, got.first, got.by) == (False, {5: SOLO}, 3, BY_REPLAY_SOLO)
    assert got.detail.endswith(": r1 still differs from A at generated #3"), got.detail


def test_rung_suspects_does_not_apply_without_other_steps_and_forces_them_all_otherwise():
    case = FakeCase(lambda f: False)
    assert C.rung_suspects(case, [C.rung_kernels(case, [])]).confirmed is None
    assert case.replays == 1  # no replay for a rung that does not apply
    case = FakeCase(lambda f: set(f) == {2, 3, 5}, pairs={2: 1, 3: 2, 5: 4})
    tried = [C.rung_kernels(case, [])]
    got = C.rung_suspects(case, tried)
    assert got.confirmed is True and set(got.forced) == {2, 3, 5} and got.forced[5] is tried[0].forced[5]
    assert got.detail.endswith("(step 5 alone does not: 2 other steps differ too)"), got.detail
    # failing, its sentence names both forcings and where each still differed
    case = FakeCase(lambda f: False, pairs={3: 2, 5: 4})
    tried = [C.rung_kernels(case, [])]
    got = C.rung_suspects(case, tried)
    assert got.confirmed is False and "still differs at generated #3; with steps 3, 5 run on A's kernels it differs" \
        in got.detail, got.detail


def test_rung_solo_runs_every_suspect_alone_only_where_kernels_were_forced():
    case = FakeCase(lambda f: all(v is SOLO for v in f.values()), pairs={3: 2, 5: 4})
    tried = [C.rung_kernels(case, [])]
    tried.append(C.rung_suspects(case, tried))
    got = C.rung_solo(case, tried)
    assert (got.confirmed, got.forced, got.by) == (True, {3: SOLO, 5: SOLO}, BY_REPLAY_SOLO)
    assert "where A's kernels alone were not enough (step 5 alone does not: 1 other step differs too)" in got.detail
    # the steps already ran as A ran them (native: SOLO): nothing more to force
    case = FakeCase(lambda f: False, kernels=False)
    assert C.rung_solo(case, [C.rung_kernels(case, [])]).confirmed is None


def test_rung_prefill_computes_the_prompt_in_as_passes():
    case = FakeCase(lambda f: False)
    assert C.rung_prefill(case, []).confirmed is None  # no passes: it does not apply
    passes = {1: RelayoutStep("r1", 0, 8), 2: RelayoutStep("r1", 8, 12)}
    case = FakeCase(lambda f: isinstance(f.get(1), RelayoutStep), passes=passes)
    got = C.rung_prefill(case, [])
    assert got.confirmed is True and got.by == BY_REPLAY_PREFILL and got.forced == {5: SOLO, **passes}
    assert "r1's prompt had to be computed in A's 2 prefill passes (its chunks in B straddle them)" in got.detail


def test_the_draw_rungs_judge_the_draw_itself():
    story = SimpleNamespace(purpose="draft", position=12, a=SimpleNamespace(token=7, accepted=True))
    case = FakeCase(lambda f: len(f) == 2, pairs={3: 2, 5: 4}, story=story)
    first = C.rung_draw(case, [])
    assert first.confirmed is False and "the draft draw of r1 at position 12 still decides otherwise" in first.detail
    got = C.rung_draw_suspects(case, [first])
    assert got.confirmed is True and got.detail.endswith("makes the draft draw of r1 at position 12 draw token 7, "
                                                         "as in A (step 5 alone does not: 1 other step differs too)")


def test_climb_stops_at_the_first_rung_that_confirms_and_unconfirmed_names_the_suspects():
    case = FakeCase(lambda f: all(v is SOLO for v in f.values()), pairs={3: 2, 5: 4})
    got, tried = C.climb(case, C.RUNGS)
    assert got.rung == "solo" and [r.rung for r in tried] == ["kernels", "suspects", "solo"]
    assert [r.confirmed for r in tried] == [False, False, True]
    got, tried = C.climb(FakeCase(lambda f: False, pairs={3: 2, 5: 4}), C.RUNGS)
    assert got is None and C.unconfirmed(tried).rung == "suspects"
    got, tried = C.climb(FakeCase(lambda f: False), C.RUNGS)
    assert got is None and C.unconfirmed(tried).rung == "kernels"


def test_the_replay_confirmer_says_how_it_confirmed(monkeypatch):
    case = FakeCase(lambda f: all(v is SOLO for v in f.values()))
    monkeypatch.setattr(confirmer, "Case", lambda *a, **k: case)
    confirm = C.ReplayConfirmer(None, None, None)
    got = confirm.confirm(case.cause, case.rd)
    assert got.confirmed is True and got.by == BY_REPLAY_SOLO and "kernels alone were not enough" in got.detail

    def refuse(forced):
        case.by_tried = BY_REPLAY
        raise C.ForcingRefused("no relayout")

    case.check = refuse
    assert confirm.confirm(case.cause, case.rd) == \
        Confirmation(False, "the replay refused a forcing it needed (no relayout)", BY_REPLAY)
    # a sampler cause without the draft has nothing to force: no confirmation ran, none is named
    target_sampler = SimpleNamespace(kind="sampler", model="target")
    got = confirm.confirm(target_sampler, case.rd)
    assert got.confirmed is None and got.by is None and "no kernel to force" in got.detail


@pytest.mark.parametrize("forced, by", [({1: SOLO, 2: RelayoutStep("r1", 0, 4)}, BY_REPLAY_SOLO),
                                        ({1: SOLO, 2: {"k_proj": "gemv"}}, BY_REPLAY), ({}, BY_REPLAY)])
def test_replay_kind(forced, by):
    assert C.replay_kind(forced) == by


def test_bisect_traces_reads_the_replay_bisections_fields(tmp_path):
    from divergence.trace.reader import Trace
    from tui import story

    pa = story.write_run(tmp_path / "serial.h5", "serial", kv_hashes=False)
    pb = story.write_run(tmp_path / "concurrent.h5", "concurrent", kv_hashes=False)
    with Trace.open(pa) as a, Trace.open(pb) as b:
        rep = bisect_traces(a, b, replay_bisector=lambda rd: ReplayBisection(None, 2, "not found: because"))
    assert set(rep.unexplained.values()) == {"not found: because"} and "(2 replays)" in rep.mode, rep.mode
