"""The sparse replay (analysis/sparse.py) gives the full replay's bits for the request it
proves, on every kind of trace the engine writes: tokens, top-k ids and logits, K/V hashes
(its own writes and the prefix-cache blocks it reads) and draws. Both ways: unforced, and
with the request's most crowded step run request by request (SOLO), as a confirmation forces
it. Kinds it is not known to hold for (MoE, tensor parallel) fall back to the whole trace and
say why. The live `serve` trace's case is in tests/serve/test_sparse_live.py.

The reference is the full replay, itself checked bit for bit against the recording
(tests/analysis/test_replay_matrix.py), so equal bits here are the recording's bits.
"""
from __future__ import annotations

import numpy as np
import pytest

from divergence import Trace
from divergence.core.policy import SOLO

from .sparse_check import assert_sparse_is_full as _assert_sparse_is_full

PREAMBLE = "Return a new list containing all items from the iterable in ascending order. A custom key function. "
TEXTS = ("The socket module provides", "If the object", "Open file and return a stream.", "Create a new thread")


def _run(root, name, *, weights="bf16", schedules=("concurrent",), policy="threshold:4", spec=False,
         sampled=False, prefix=False, model_type="llama", extra=None):
    from divergence.core.request import Request, Sampling
    from divergence.fixtures import DRAFT
    from divergence.testing.models import make_random_model
    from divergence.workloads.runner import RunConfig, load_models, run_schedules

    model = root / f"model-{model_type}-{weights}"
    if not model.exists():
        make_random_model(model, model_type=model_type, hidden_size=64, num_layers=2, heads=4, kv_heads=2,
                          intermediate_size=128, dtype="float32" if weights == "fp32" else "bfloat16",
                          quantize_bits=4 if weights == "4bit" else None, **(extra or {}))
    cfg = RunConfig(model=model, draft=DRAFT if spec else None, policy=policy, spec_k=3 if spec else 0,
                    token_budget=64, top_k=4, prefix_caching=prefix, stop_at_eos=False)
    target, draft = load_models(cfg)
    reqs = [Request(f"r{i}", tuple(target.encode(PREAMBLE + t)), max_tokens=12, arrival=3 * i,
                    sampling=Sampling(0.8, 0.95, 1000 + i) if sampled else Sampling())
            for i, t in enumerate(TEXTS)]
    out = root / name
    run_schedules(cfg, target, draft, reqs, schedules, out)
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("sparse")


KINDS = {  # name -> (run settings, schedule)
    "dense-bf16": (dict(), "concurrent"),
    "dense-fp32-native": (dict(weights="fp32", policy="native"), "concurrent"),
    "4bit": (dict(weights="4bit"), "concurrent"),
    "prefix-cache": (dict(prefix=True), "concurrent"),
    "warm": (dict(schedules=("warm",)), "warm"),
    "spec-greedy": (dict(spec=True), "concurrent"),
    "spec-sampled": (dict(spec=True, sampled=True), "concurrent"),
    "sampled": (dict(sampled=True, policy="batch-invariant"), "concurrent"),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_sparse_replay_gives_the_full_replays_bits(kind, root):
    kw, schedule = KINDS[kind]
    out = _run(root, kind, **kw)
    _assert_sparse_is_full(out / f"{schedule}.h5")


def test_a_prefix_hit_makes_its_writer_real(root):
    """With the prefix cache, the request reads blocks that an earlier one wrote: that writer
    is replayed for real from its own arrival (a stand-in's K/V would be garbage there)."""
    from divergence.analysis.sparse import plan_window

    out = _run(root, "prefix-cache", prefix=True)
    with Trace.open(out / "concurrent.h5") as t:
        plans = list(t.iter_plans())
        last = t.requests[-1].id
        hit = next(s.start for p in plans for s in p.slices if s.request_id == last)
        assert hit > 0  # it found its prompt's first blocks in the cache
        w = plan_window(t, {last}, None)
        assert len(w.real) > 1 and w.first == 0, w  # the writer, from step 0
        # (the bits themselves: test_the_sparse_replay_gives_the_full_replays_bits[prefix-cache])


def test_batch_generator_traces_replay_sparse_bit_for_bit(root, target):
    """mlx-lm's BatchGenerator trace (the engine stands in for it on replay)."""
    from divergence.core.request import Request
    from divergence.trace.writer import TraceWriter
    from divergence.workloads.mlxlm_batch import run_batch_generator

    reqs = [Request(f"p{i}", tuple(target.encode(t)), max_tokens=8) for i, t in enumerate(TEXTS)]
    path = root / "bg-concurrent.h5"
    with TraceWriter(path, top_k=8, kv_hashes=True) as w:
        run_batch_generator(target, reqs, "concurrent", [w])
    _assert_sparse_is_full(path, forced_too=False)  # (BatchGenerator's steps are replayed on native kernels)


def test_moe_traces_fall_back_to_the_whole_trace_and_say_why(root):
    from divergence.analysis.sparse import MOE

    out = _run(root, "moe", model_type="qwen3_moe", policy="native", extra=dict(num_experts=8, experts_per_token=2))
    t = _assert_sparse_is_full(out / "concurrent.h5", expect_sparse=False, forced_too=False)
    from divergence.analysis.replayer import Replayer

    with Trace.open(t.path) as t:
        rid = t.requests[-1].id
        got = Replayer().run(t, focus={rid}, stop_after=int(t.tokens(rid).steps[-1]))
        assert got.full_because == MOE


def test_tensor_parallel_traces_fall_back_and_say_why():
    from types import SimpleNamespace

    from divergence.analysis.sparse import TP, plan_window

    trace = SimpleNamespace(tp_degree=2, has_routing=False, meta={}, requests=[])
    assert plan_window(trace, {"r1"}, None) == TP


def test_requests_forced_alike_share_one_replay_with_their_own_bits(root, monkeypatch):
    """share_replay: one checked replay for several requests forced the same way; each one's
    confirmation then reads it (no replay of its own), and gets the bits its own would give."""
    from divergence.analysis.confirm.replays import checked_replay, share_replay, step_of_token
    from divergence.analysis.replayer import Replayer

    out = _run(root, "dense-bf16")
    with Trace.open(out / "concurrent.h5") as t:
        ids = [r.id for r in t.requests][1:]
        step = max((p for p in t.iter_plans() if sum(s.request_id in ids for s in p.slices) > 1),
                   key=lambda p: len(p.slices)).index
        forced = {step: SOLO}
        until = {rid: step_of_token(t, rid, len(t.tokens(rid).tokens)) for rid in ids}
        shared, alone = Replayer(), Replayer()
        share_replay(shared, t, forced, until)
        runs = []
        monkeypatch.setattr(Replayer, "run", lambda self, *a, **k: runs.append(1) or pytest.fail("replayed again"))
        got = {rid: checked_replay(shared, t, forced, focus={rid}, until=until[rid]).outputs[rid] for rid in ids}
        monkeypatch.undo()
        for rid in ids:
            own = checked_replay(alone, t, forced, focus={rid}, until=until[rid]).outputs[rid]
            n = len(own.tokens)
            assert n and list(got[rid].tokens[:n]) == list(own.tokens), rid
            assert np.asarray(got[rid].topk_logits[:n], np.float32).tobytes() == \
                np.asarray(own.topk_logits, np.float32).tobytes(), rid


def test_confirmations_are_the_full_replays_on_sampled_speculative_traffic(tmp_path):
    """Diagnosis truth does not move: the same causes, confirmed the same way, with the sparse
    replay as with the full one, on sampled speculative traffic whose suspect steps include a
    draft step after the token the check reads (the fixture models, the demo's policy)."""
    from divergence.analysis.pipeline import AnalysisOptions, analyze_pair
    from divergence.analysis.replayer import Replayer
    from divergence.core.request import Request, Sampling
    from divergence.fixtures import DRAFT, TARGET
    from divergence.workloads.runner import RunConfig, load_models, run_schedules

    cfg = RunConfig(model=TARGET, draft=DRAFT, policy="threshold:4", spec_k=3, stop_at_eos=False)
    target, draft = load_models(cfg)
    texts = ("The socket module provides", "Return the number of", "If the object", "Open file and return a stream.")
    reqs = [Request(f"r{i + 1}", tuple(target.encode(t)), max_tokens=24, arrival=2 * i,
                    sampling=Sampling(0.8, 0.95, 7 + i)) for i, t in enumerate(texts)]
    run_schedules(cfg, target, draft, reqs, ("serial", "concurrent"), tmp_path)
    got = {}
    for sparse in (True, False):
        replayer = Replayer(sparse=sparse)
        opts = AnalysisOptions(confirm=True, make_replayer=lambda m, d: replayer, note=lambda s: None)
        with Trace.open(tmp_path / "serial.h5") as a, Trace.open(tmp_path / "concurrent.h5") as b:
            rep = analyze_pair(a, b, opts)
        got[sparse] = {rid: (c.kind, c.a.step, c.b.step, rep.finding(rid).confirmed,
                             rep.confirmations[rid].detail, str(rep.first_ops.get(rid)))
                       for rid, c in rep.causes.items()}
    assert got[True] == got[False]
    assert got[True] and all(v[3] for v in got[True].values()), got[True]
