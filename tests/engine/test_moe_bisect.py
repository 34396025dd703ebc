"""MoE traces through diagnosis: threshold:1 diverges and every diverged request
gets a replay-confirmed cause; batch-invariant stays bitwise identical; a planted
near-tie in a router shows up as a routing flip in the bisect report, explained
(the gate's own kernel, or contaminated input)."""
from __future__ import annotations

import numpy as np
import pytest

from divergence.analysis.bisect import bisect_traces
from divergence.analysis.diff import diff_traces
from divergence.analysis.replayer import Replayer, ReplayConfirmer
from divergence.analysis.report import render_bisect
from divergence.core.request import Request
from divergence.workloads.runner import RunConfig, run_schedules
from divergence.testing.models import make_random_model
from divergence.trace.reader import Trace

SHAPE = dict(hidden_size=64, num_layers=2, num_experts=8, experts_per_token=2)
PROMPTS = [("Return the number of", 0), ("The socket module provides", 2), ("If the object", 0),
           ("Convert a number or string to an integer", 5)]


def _requests(loaded, n=24):
    return [Request(f"r{i}", tuple(loaded.encode(p)), max_tokens=n, arrival=a) for i, (p, a) in enumerate(PROMPTS)]


def _run(loaded, policy, out, schedules=("serial", "concurrent"), n=24):
    run_schedules(RunConfig(model=loaded.path, policy=policy), loaded, None, _requests(loaded, n), schedules, out)
    return [out / f"{s}.h5" for s in schedules]


@pytest.mark.parametrize("family,kw", [("mixtral", dict(dtype="bfloat16", quantize_bits=4)),
                                       ("qwen3_moe", dict(dtype="bfloat16"))])
def test_threshold_diverges_and_every_cause_is_confirmed(random_model, tmp_path, family, kw):
    loaded = random_model(family, **SHAPE, **kw)
    pa, pb = _run(loaded, "threshold:1", tmp_path)
    with Trace.open(pa) as a, Trace.open(pb) as b:
        assert a.has_routing and b.has_routing
        ks = b.kernels()
        experts = ks["op"] == "experts"
        assert set(ks["kernel"][experts]) == {"gemv", "gemm"}  # per expert, from the rows it received
        assert (ks["expert"][experts] >= 0).all() and (ks["expert"][~experts] == -1).all()
        report = bisect_traces(a, b, bitwise=True, confirm=True, confirmer=ReplayConfirmer(a, b, Replayer()))
        diverged = [r.id for r in report.diff.requests if r.status == "diverged"]
        assert diverged, "threshold:1 should make serial and concurrent differ"
        assert set(report.causes) == set(diverged)
        assert all(report.confirmations[rid].confirmed for rid in report.causes), render_bisect(report)
        # replay re-executes the MoE trace bit for bit, routing included
        rep = Replayer().replay_to_file(b, tmp_path / "replay.h5")
        assert rep.faithful, rep.to_json()
        with Trace.open(tmp_path / "replay.h5") as c:
            for r in b.requests:
                rb, rc = b.routing(r.id), c.routing(r.id)
                assert np.array_equal(rb["experts"], rc["experts"]) and np.array_equal(rb["input_hash"], rc["input_hash"])


@pytest.mark.parametrize("family,kw", [("mixtral", dict(dtype="float32")),
                                       ("qwen3_moe", dict(dtype="bfloat16", quantize_bits=4))])
def test_batch_invariant_is_bitwise_identical(random_model, tmp_path, family, kw):
    loaded = random_model(family, **SHAPE, **kw)
    pa, pb = _run(loaded, "batch-invariant", tmp_path, n=16)
    with Trace.open(pa) as a, Trace.open(pb) as b:
        d = diff_traces(a, b, bitwise=True)
        assert d.identical
        for r in a.requests:  # the routing too, exactly
            ra, rb = a.routing(r.id), b.routing(r.id)
            assert np.array_equal(ra["experts"], rb["experts"])
            assert np.array_equal(ra["scores"].view(np.uint32), rb["scores"].view(np.uint32))
            assert np.array_equal(ra["input_hash"], rb["input_hash"])


def _planted(tmp_path, layer):
    """A mixtral whose router at `layer` has every row equal up to a scale of noise at which
    it flips on this backend (divergence.testing.near_tie); serial trace A under native,
    B = A replayed with every step's router on a split-K gemm."""
    from divergence.testing.near_tie import planted_router_pair

    def on_the_path(a, b):  # a flip the bisect of a divergence walks through, not any flip
        causes = bisect_traces(a, b, bitwise=True).causes.values()
        return any(c.routing_flip is not None and c.routing_flip.layer == layer for c in causes)

    return planted_router_pair(tmp_path, layer, [p for p, _ in PROMPTS], arrivals=[a for _, a in PROMPTS],
                               flipped=on_the_path, dtype="float32", **SHAPE)


@pytest.mark.blas
@pytest.mark.parametrize("layer", [0, 1])
def test_planted_near_tie_shows_the_routing_flip(tmp_path, layer):
    """The flip's cause is the gate's own kernel where the router saw the same input in both
    runs (always at layer 0: its input is the embedding), else the contaminated input. At
    layer 1 which one it is depends on whether layer 0's gemm:2 gate changed any bits on this
    BLAS core: the router input hashes say, independently of the bisect."""
    pa, pb = _planted(tmp_path, layer)
    with Trace.open(pa) as a, Trace.open(pb) as b:
        report = bisect_traces(a, b, bitwise=True)
        text = render_bisect(report, a.vocab)
        flips = {rid: c.routing_flip for rid, c in report.causes.items() if c.routing_flip is not None}
        assert flips, text
        kinds = set()
        for rid, f in flips.items():
            assert f.layer == layer and f.experts_a != f.experts_b
            # independently, from the routing tables: the sets differ there, the inputs agree or not
            ra, rb = a.routing(rid), b.routing(rid)
            i = np.flatnonzero((ra["layer"] == f.layer) & (ra["position"] == f.position))[0]
            j = np.flatnonzero((rb["layer"] == f.layer) & (rb["position"] == f.position))[0]
            assert sorted(ra["experts"][i]) == f.experts_a and sorted(rb["experts"][j]) == f.experts_b
            same_input = bool(ra["input_hash"][i] == rb["input_hash"][j])
            assert f.cause == ("gate_kernel" if same_input else "contaminated_input")
            if layer == 0:
                assert same_input
            if same_input:  # the same router input, other experts: the gate kernel did it
                assert (f.gate_a, f.gate_b) == ("native", "gemm/2")
            kinds.add(f.cause)
            assert f"routing flip: layer {layer}, position {f.position}" in text
        assert ("from the gate's own kernel" in text) == ("gate_kernel" in kinds)
        j = report.to_json()
        assert any(r["root_cause"] and r["root_cause"]["routing_flip"] for r in j["requests"])
