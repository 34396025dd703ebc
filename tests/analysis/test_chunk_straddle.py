"""A chunked prefill whose chunk boundaries differ between the schedules is confirmed.

Serial, a long prompt is prefilled in chunks of the token budget; concurrent, the same
budget is shared with other requests' decode rows, so its chunks are shorter and
straddle serial's. On fp32 OpenBLAS a row's bits depend on the pass it was computed
in, so no single step run as serial ran it reproduces serial's K/V: the confirmation
has to compute the whole prompt in serial's passes (forcing.prefill_as_a, several
relayouts of one request in one replay). Before that, the long request's logit-only
divergence was named but NOT confirmed.
"""
from __future__ import annotations

import pytest

from divergence import Trace
from divergence.analysis.bisect import bisect_traces
from divergence.analysis.step_view import step_kernels
from divergence.analysis.forcing import force_like_a, prefill_as_a
from divergence.analysis.replayer import Replayer, ReplayConfirmer
from divergence.analysis.report import render_bisect
from divergence.engine.kernels.blas import blas_in_use
from divergence.core.policy import RelayoutStep
from divergence.core.request import Request
from divergence.workloads.runner import RunConfig, run_schedules

pytestmark = [pytest.mark.blas,
              pytest.mark.skipif(not blas_in_use().startswith("OpenBLAS"),
                                 reason="needs OpenBLAS (.ci/run installs it): under the reference BLAS an fp32 "
                                        "row's bits do not depend on its pass, and the schedules do not differ")]


@pytest.fixture
def no_relayout(monkeypatch):
    """The replay refuses every relayout (as it refuses one that does not fit the plans)."""
    import divergence.analysis.replayer as replayer

    def refuse(plans, sites, forced, requests):
        if any(isinstance(v, RelayoutStep) for v in forced.values()):
            raise ValueError("no relayout today")
        return plans, sites, forced

    monkeypatch.setattr(replayer, "relayout", refuse)


def _run(loaded, out, schedules=("serial", "concurrent"), *, budget=20, long=50, kv_hashes=True):
    reqs = [Request("S", tuple(loaded.encode("Return the number of")), max_tokens=24),
            Request("T", tuple(loaded.encode("If the object")), max_tokens=24),
            Request("L", tuple(range(7, 7 + long)), max_tokens=8, arrival=2)]
    cfg = RunConfig(model=loaded.path, dtype="float32", token_budget=budget, stop_at_eos=False, kv_hashes=kv_hashes)
    run_schedules(cfg, loaded, None, reqs, schedules, out)
    return [out / f"{s}.h5" for s in schedules]


def test_a_prefill_in_other_chunks_is_confirmed_in_the_other_traces_passes(random_model, tmp_path):
    loaded = random_model("llama", dtype="float32")
    pa, pb = _run(loaded, tmp_path)
    with Trace.open(pa) as a, Trace.open(pb) as b:
        chunks = {t: [(s.start, s.count) for p in t.iter_plans() for s in p.slices
                      if s.request_id == "L" and s.phase == "prefill"] for t in (a, b)}
        assert chunks[a] == [(0, 20), (20, 20), (40, 10)] and chunks[b] != chunks[a]
        passes = prefill_as_a(a, b, "L", b.num_steps)
        assert [(r.start, r.end) for r in passes.values()] == [(0, 20), (20, 40), (40, 50)]
        assert all(isinstance(r, RelayoutStep) for r in passes.values())
        # one step alone: A's first chunk of L ran without logit rows (no lm_head), B's beside
        # decode rows (lm_head too); every op both ran is native, so the forcing is the rows
        # (run alone, A's span), not "A's kernels", which would change nothing
        step_a = next(p.index for p in a.iter_plans() for s in p.slices if s.request_id == "L" and s.start == 0)
        step_b = next(iter(passes))
        assert "lm_head" not in step_kernels(a, step_a) and "lm_head" in step_kernels(b, step_b)
        assert force_like_a(a, step_a, b, step_b, "L") == RelayoutStep("L", 0, 20)

        report = bisect_traces(a, b, bitwise=True, confirm=True, confirmer=ReplayConfirmer(a, b, Replayer()))
        cause, proof = report.causes.get("L"), report.confirmations.get("L")
        assert cause is not None, render_bisect(report)
        assert proof.confirmed, render_bisect(report)
        assert "prefill passes" in proof.detail, proof.detail


def test_a_prefill_from_the_warm_up_copy_is_confirmed_in_the_other_traces_passes(random_model, tmp_path):
    """`warm`: L's first blocks come from its warm-up copy through the prefix cache (computed
    in chunks beside the other copies' rows), then L computes the rest itself. Confirmed
    with the passes below the hit given to the warm-up copy's prefill steps and the last
    one, recomputed from its start, to L's own step."""
    loaded = random_model("llama", dtype="float32")
    pa, pw = _run(loaded, tmp_path, ("serial", "warm"))
    with Trace.open(pa) as a, Trace.open(pw) as w:
        own = [(s.start, s.count) for p in w.iter_plans() for s in p.slices if s.request_id == "L"
               and s.phase == "prefill"]
        assert own and own[0][0] > 0, own  # a prefix-cache hit
        passes = prefill_as_a(a, w, "L", w.num_steps)
        assert [(r.request_id, r.start, r.end) for r in passes.values()] == \
            [("warmup/L", 0, 20), ("warmup/L", 20, 40), ("L", 40, 50)]
        report = bisect_traces(a, w, bitwise=True, confirm=True, confirmer=ReplayConfirmer(a, w, Replayer()))
        assert "L" in report.causes and report.confirmations["L"].confirmed, render_bisect(report)


def test_a_forcing_the_replay_refuses_leaves_the_cause_unconfirmed(random_model, tmp_path, no_relayout):
    """A forced replay that cannot be laid out (here: every relayout refused) is reported as
    an unconfirmed cause with the reason; the bisect of the other requests goes on."""
    loaded = random_model("llama", dtype="float32")
    pa, pb = _run(loaded, tmp_path)
    with Trace.open(pa) as a, Trace.open(pb) as b:
        report = bisect_traces(a, b, bitwise=True, confirm=True, confirmer=ReplayConfirmer(a, b, Replayer()))
        proof = report.confirmations["L"]
        assert proof.confirmed is False and "refused a forcing it needed (no relayout today)" in proof.detail
        assert any(p.confirmed for rid, p in report.confirmations.items() if rid != "L"), render_bisect(report)


def test_passes_b_took_in_fewer_steps_run_one_after_the_other(random_model, tmp_path):
    """warm, an 80-token prompt, a budget of 24: serial's passes are [0:24] [24:48] [48:72]
    [72:80]; L hits its warm-up copy's blocks up to 64 and computes [64:80] in one step. That
    step runs serial's last two passes one after the other (RelayoutStep.then)."""
    loaded = random_model("llama", dtype="float32")
    pa, pw = _run(loaded, tmp_path, ("serial", "warm"), budget=24, long=80)
    with Trace.open(pa) as a, Trace.open(pw) as w:
        passes = prefill_as_a(a, w, "L", w.num_steps)
        assert [(r.request_id, r.spans) for r in passes.values()] == \
            [("warmup/L", ((0, 24),)), ("warmup/L", ((24, 48),)), ("L", ((48, 72), (72, 80)))]
        report = bisect_traces(a, w, bitwise=True, confirm=True, confirmer=ReplayConfirmer(a, w, Replayer()))
        assert "L" in report.causes and report.confirmations["L"].confirmed, render_bisect(report)


def test_without_kv_hashes_the_replay_bisection_finds_logit_causes_and_the_chunking(random_model, tmp_path):
    """No KV hashes: bisect searches B's steps by replay. Logit-only divergences (--bitwise)
    get a cause too, and where no forcing of single steps helps, the prompt in A's passes."""
    from divergence.analysis.replayer import make_replay_bisector

    loaded = random_model("llama", dtype="float32")
    pa, pb = _run(loaded, tmp_path, kv_hashes=False)
    with Trace.open(pa) as a, Trace.open(pb) as b:
        assert not b.has_kv_hashes
        report = bisect_traces(a, b, bitwise=True, replay_bisector=make_replay_bisector(a, b, Replayer()))
        diverged = [r.id for r in report.diff.requests if r.status == "diverged"]
        assert "L" in diverged and all(report.diff.requests[i].logits_only for i, r in
                                       enumerate(report.diff.requests) if r.id in diverged)
        assert set(report.causes) == set(diverged) and not report.unexplained, render_bisect(report)
        assert all(report.confirmations[rid].confirmed for rid in report.causes)
        assert "prefill passes" in report.confirmations["L"].detail, report.confirmations["L"].detail


def test_without_kv_hashes_a_forcing_the_replay_refuses_is_said(random_model, tmp_path, no_relayout):
    """The replay bisection's fallback (the prompt in A's passes) refused by the replay: the
    request says why it has no cause; the bisect goes on."""
    from divergence.analysis.replayer import make_replay_bisector
    loaded = random_model("llama", dtype="float32")
    pa, pb = _run(loaded, tmp_path, kv_hashes=False)
    with Trace.open(pa) as a, Trace.open(pb) as b:
        report = bisect_traces(a, b, bitwise=True, replay_bisector=make_replay_bisector(a, b, Replayer()))
        assert "L" not in report.causes
        assert report.unexplained["L"] == "not found by replay: the replay refused a forcing it needed (no relayout today)"
