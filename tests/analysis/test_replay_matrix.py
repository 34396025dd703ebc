"""Replay fidelity and confirmation across the configurations the engine records.

Models: a tiny random llama (hidden 64, 2 layers) with the fixtures' tokenizer, in bf16,
fp32 and 4-bit, and the fixture draft for speculative decoding.

Factors: schedule (serial / concurrent / warm) x prefix cache (off / on) x speculative
k (0 / 3) x sampling (greedy / temperature 0.8, top_p 0.95, per-request seeds) x policy
(threshold:4 / native / batch-invariant) x weights (bf16 / fp32 / 4-bit).

The full product is 216 traces; at a few seconds each that is too slow for CI. So the
cells form a pairwise covering design: the 3 x 3 (policy, weights) product, and the
three two-level factors chosen so that every pair of levels of any two factors appears
in some cell (checked below). Every cell runs all three schedules, so schedule pairs
with every other factor too. In each cell:
- the unforced replay of each of the three traces equals the original bit for bit
  (tokens, top-k logits, KV hashes, and for sampled cells every draw and its outcome);
- for the serial/concurrent and serial/warm pairs, every request that diverges, logits
  included (--bitwise), gets a root cause and `bisect --confirm` confirms it.
"""
from __future__ import annotations

import itertools

import pytest

from divergence import Trace

POLICIES = ("threshold:4", "native", "batch-invariant")
WEIGHTS = ("bf16", "fp32", "4bit")
# (policy, weights, prefix cache, spec k, sampled): a covering array of strength 2
CELLS = [
    (0, 0, 1, 1, 0), (0, 1, 0, 1, 1), (0, 2, 0, 0, 0),
    (1, 0, 0, 0, 0), (1, 1, 1, 0, 0), (1, 2, 1, 1, 1),
    (2, 0, 0, 0, 1), (2, 1, 1, 0, 0), (2, 2, 0, 1, 0),
]
LEVELS = (3, 3, 2, 2, 2)
SCHEDULES = ("serial", "concurrent", "warm")
PREAMBLE = "Return a new list containing all items from the iterable in ascending order. A custom key function. "
TEXTS = ("The socket module provides", "If the object", "Open file and return a stream.")
MAX_TOKENS = 16


def cell_id(c) -> str:
    p, w, prefix, spec, sampled = c
    return (f"{POLICIES[p].replace(':', '')}-{WEIGHTS[w]}-{'prefix' if prefix else 'cold'}-k{3 if spec else 0}-"
            f"{'sampled' if sampled else 'greedy'}")


def test_the_cells_cover_every_pair_of_levels():
    for (i, a), (j, b) in itertools.combinations(enumerate(LEVELS), 2):
        have = {(c[i], c[j]) for c in CELLS}
        assert have == set(itertools.product(range(a), range(b))), (i, j)


_RUNS: dict = {}
_MODELS: dict = {}


def _model(weights: str, root):
    """A tiny random llama with the fixtures' tokenizer (so the fixture draft fits), in the
    cell's weights: random weights leave near-ties everywhere, so batching flips tokens
    in a few steps, and 4-bit stays fast on a CPU (MLX's CPU quantized matmul is slow)."""
    if weights not in _MODELS:
        from divergence.testing.models import make_random_model

        _MODELS[weights] = make_random_model(
            root / f"model-{weights}", hidden_size=64, num_layers=2, heads=4, kv_heads=2, intermediate_size=128,
            dtype="float32" if weights == "fp32" else "bfloat16", quantize_bits=4 if weights == "4bit" else None)
    return _MODELS[weights]


def _run_cell(c, root):
    """The cell's three traces (once per session)."""
    if c in _RUNS:
        return _RUNS[c]
    from divergence.core.request import Request, Sampling
    from divergence.fixtures import DRAFT
    from divergence.workloads.runner import RunConfig, load_models, run_schedules

    p, w, prefix, spec, sampled = c
    cfg = RunConfig(model=_model(WEIGHTS[w], root), draft=DRAFT if spec else None, policy=POLICIES[p],
                    spec_k=3 if spec else 0, token_budget=128, top_k=4, prefix_caching=bool(prefix), stop_at_eos=False)
    target, draft = load_models(cfg)
    reqs = [Request(f"r{i}", tuple(target.encode(PREAMBLE + t)), max_tokens=MAX_TOKENS, arrival=2 * i,
                    sampling=Sampling(0.8, 0.95, 1000 + i) if sampled else Sampling())
            for i, t in enumerate(TEXTS)]
    out = root / cell_id(c)
    run_schedules(cfg, target, draft, reqs, SCHEDULES, out)
    _RUNS[c] = out
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("matrix")


@pytest.fixture(scope="module")
def replayer():
    from divergence.analysis.replayer import Replayer

    return Replayer()


@pytest.mark.parametrize("c", CELLS, ids=cell_id)
def test_unforced_replay_is_bitwise_the_original(c, root, replayer):
    from divergence.analysis.replayer import fidelity
    from divergence.trace.writer import TraceWriter

    out = _run_cell(c, root)
    for s in SCHEDULES:
        with Trace.open(out / f"{s}.h5") as t:
            path = out / f"{s}.replay.h5"
            with TraceWriter(path, top_k=t.meta["settings"]["top_k"], kv_hashes=True) as w:
                replayer.run(t, observers=[w])
            with Trace.open(path) as r:
                f = fidelity(t, r, {}, 0.0, None)
            assert f.tokens_equal and f.logits_equal and f.kv_equal, (s, f.first_difference, f.kv_first_difference)
            sampled = c[4]
            # sampled cells: the replay drew the same uniforms with the same outcomes, rejection tests included
            assert f.draws_equal is (True if sampled else None), s


@pytest.mark.parametrize("c", CELLS, ids=cell_id)
def test_every_divergence_is_confirmed(c, root, replayer):
    from divergence.analysis.bisect import bisect_traces
    from divergence.analysis.replayer import ReplayConfirmer

    out = _run_cell(c, root)
    for s in SCHEDULES[1:]:
        with Trace.open(out / "serial.h5") as a, Trace.open(out / f"{s}.h5") as b:
            rep = bisect_traces(a, b, confirm=True, confirmer=ReplayConfirmer(a, b, replayer, "serial", s),
                                bitwise=True)
            for r in rep.diff.diverged:
                cause, proof = rep.causes.get(r.id), rep.confirmations.get(r.id)
                assert cause is not None, (s, r.id)
                assert proof.confirmed, (s, r.id, cause.kind, proof.detail)
