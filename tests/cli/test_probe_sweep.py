"""probe maps row-count classes; sweep counts unique completions."""
from __future__ import annotations

import json

import mlx.core as mx
import pytest

from divergence.cli.main import main
from divergence.engine.kernels.dispatch import KernelDispatcher, KernelPolicy
from divergence.core.classes import OpProbe, classify
from divergence.workloads.probe import probe_linear


def test_classify_groups_by_bits():
    import numpy as np

    a, b = np.array([1, 2], np.uint16), np.array([1, 3], np.uint16)
    assert classify([a, a, b, b, a]) == [0, 0, 1, 1, 0]
    p = OpProbe("q_proj", "8x8", "bfloat16", [1, 2, 3, 8, 9], [0, 0, 0, 1, 1])
    assert p.describe() == "rows 1..3 = M=1, 8..9 class 1"
    q = OpProbe("q_proj", "8x8", "float32", [1, 2, 13, 14, 15], [0, 0, 1, 2, 1])
    assert q.describe() == "rows 1..2 = M=1, 13..15 differ (2 classes)"


def test_probe_finds_the_split_of_the_engines_own_gemm(target):
    """threshold:4 runs gemv up to 4 rows and split-K gemm above: the probe must see it."""
    from divergence.engine.model.forward import PackedForward

    op = PackedForward(target).ops[0].q
    disp = KernelDispatcher(KernelPolicy.parse("threshold:4"), "target")
    rows = list(range(1, 13))
    classes = probe_linear(op, rows, mx.bfloat16, run=lambda x, o: disp(x, o, 0))
    assert classes[:4] == [0, 0, 0, 0]
    assert all(c != 0 for c in classes[4:])


def test_probe_cli_on_bf16_fixture_one_class_per_op(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DIVERGENCE_CACHE_DIR", str(tmp_path))
    assert main(["probe", "--rows", "1..24", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    ops = {o["op"]: o for o in report["ops"]}
    assert {"q_proj", "k_proj", "down_proj", "lm_head", "sdpa"} <= set(ops)
    # SDPA at each default KV length, over query lengths up to it
    sdpa = [o for o in report["ops"] if o["op"] == "sdpa"]
    assert [o["shape"].rsplit("kv ", 1)[1] for o in sdpa] == ["64", "256", "1024"]
    assert all(o["rows"] == list(range(1, 25)) for o in sdpa)
    # MLX's own bf16 matmul on the CPU is batch-invariant: one class per linear op
    for name, o in ops.items():
        if name != "sdpa":
            assert set(o["classes"]) == {0}, (name, o["summary"])
    assert (tmp_path / "probe.json").exists()


@pytest.mark.blas
def test_probe_fp32_classes_are_what_a_direct_check_of_the_rows_finds(capsys, tmp_path, monkeypatch):
    """The probe's fp32 map of down_proj against an independent check, on whatever kernels
    this BLAS core picks: plain `x @ W.T` calls of M rows, each row's bits against the row
    computed alone. Class 0 exactly where they agree (Haswell kernels: M <= 9; SkylakeX /
    Cooperlake: depends on the whole shape; the reference BLAS: every M)."""
    import numpy as np

    from divergence.engine.kernels.blas import blas_in_use
    from divergence.engine.model.loading import load_model
    from divergence.fixtures import TARGET

    monkeypatch.setenv("DIVERGENCE_CACHE_DIR", str(tmp_path))
    rows = [1, 2, 4, 8, 16, 32, 64]
    assert main(["probe", "--dtype", "float32", "--rows", ",".join(map(str, rows)), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    down = next(o for o in report["ops"] if o["op"] == "down_proj")
    w = load_model(TARGET, dtype="float32").model.model.layers[0].mlp.down_proj.weight
    x = mx.random.normal((64, w.shape[1]), key=mx.random.key(3))

    def bits(a):
        mx.eval(a)
        return np.array(a).view(np.uint32)

    alone = np.concatenate([bits(x[i: i + 1] @ w.T) for i in range(64)])
    direct = [all(np.array_equal(bits(x[j: j + m] @ w.T), alone[j: j + m]) for j in range(0, 64, m)) for m in rows]
    assert [c == 0 for c in down["classes"]] == direct, (blas_in_use(), down["summary"])
    if blas_in_use().startswith("reference"):
        assert all(direct)  # DESIGN.md: the bundled reference BLAS is batch-invariant


def test_sweep_counts_unique_completions(capsys):
    assert main(["sweep", "-n", "4", "--max-tokens", "24", "--max-batch", "4", "--policy", "batch-invariant",
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["runs"] == 4 and r["unique_completions"] == 1 and r["counts"] == [4]
    assert r["stream"]["engine_runs"] == 1 and len(r["batch_sizes"]) == 4 and max(r["batch_sizes"]) <= 4


# -- the sweep's stream -----------------------------------------------------------------------

FILLER_LIVES = [(12, 48), (19, 29), (20, 48), (21, 1), (16, 1), (32, 48), (21, 1), (17, 48)]


def _lives(chunk, needle_life, natural):
    return [(r, needle_life if r.id.startswith("n") else min(r.max_tokens, natural[r.prompt_tokens])) for r in chunk]


def _occupancy(chunk, needle_life, natural) -> dict:
    occ: dict[int, int] = {}
    for r, life in _lives(chunk, needle_life, natural):
        for c in range(r.arrival, r.arrival + life):
            occ[c] = occ.get(c, 0) + 1
    return occ


def _plan(seed, runs, max_batch, needle_life=11, max_tokens=48):
    import random

    from divergence.workloads.sweep import plan_stream

    fillers = [(tuple([i + 2] * p), n) for i, (p, n) in enumerate(FILLER_LIVES)]
    stream = plan_stream(random.Random(seed), runs, max_batch, (1,) * 5, needle_life, fillers, max_tokens)
    return stream, dict(fillers)


def _within_segments(stream, natural, needle_life=11):
    """Each step holds at most its segment's batch."""
    for chunk, segs in zip(stream.chunks, stream.segments):
        occ = _occupancy(chunk, needle_life, natural)
        assert segs[0][0] == 0 and all(a[1] == b[0] for a, b in zip(segs, segs[1:]))
        for start, end, b in segs:
            assert all(occ.get(c, 0) <= b for c in range(start, end)), (start, end, b)
        assert max(occ) < segs[-1][1]


@pytest.mark.parametrize("max_batch, runs, needle_life", [(1, 300, 11), (3, 300, 11), (8, 300, 11), (8, 1000, 11),
                                                        (8, 40, 30)])
def test_stream_plans_every_needle_once_and_never_more_than_max_batch_a_step(max_batch, runs, needle_life):
    for seed in range(6):
        stream, natural = _plan(seed, runs, max_batch, needle_life)
        chunks = stream.chunks
        _within_segments(stream, natural, needle_life)
        ids = [r.id for c in chunks for r in c]
        needles = [i for i in ids if i.startswith("n")]
        assert sorted(needles) == sorted(f"n{i}" for i in range(runs)) and len(set(ids)) == len(ids)
        assert all(c == sorted(c, key=lambda r: r.arrival) for c in chunks)
        occ = _occupancy(chunks[0], needle_life, natural)
        assert max(occ.values()) <= max_batch
        if max_batch == 1:
            assert ids == needles and set(occ.values()) == {1}
        else:
            assert len(ids) > len(needles)  # co-batched traffic
            assert len(set(occ.values())) >= (max_batch - 1 if runs >= 300 else 3)  # batch sizes vary
            assert len(stream.segments[0]) >= 6  # a short sweep too
        arrivals = sorted(r.arrival for r in chunks[0] if r.id.startswith("n"))
        assert len(set(arrivals)) > 0.7 * len(arrivals)  # staggered, mostly distinct steps


def test_stream_is_seeded():
    a, b, c = (_plan(seed, 100, 8)[0].chunks for seed in (7, 7, 8))
    assert a == b and a != c


def test_a_long_stream_runs_as_bounded_chunks(monkeypatch):
    import divergence.workloads.sweep as sw

    monkeypatch.setattr(sw, "STREAM_TOKENS", 4000)
    stream, natural = _plan(0, 300, 6)
    chunks = stream.chunks
    _within_segments(stream, natural)
    assert len(chunks) > 2
    needles = [r.id for c in chunks for r in c if r.id.startswith("n")]
    assert sorted(needles) == sorted(f"n{i}" for i in range(300))
    for c in chunks:
        assert min(r.arrival for r in c) == 0
        assert max(_occupancy(c, 11, natural).values()) <= 6
        assert sum(len(r.prompt_tokens) + r.max_tokens + 1 for r in c) < 4000 + 6 * 8 * 11 * (5 + 48 + 1)


class _FakeEngine:
    """Needles arriving at a step = 1 mod 3 get another third token: the sweep's bookkeeping
    of counts, first differences and batch sizes, without a model."""

    policy = "fake"

    def __init__(self):
        self.observers = []

    def encode(self, text):
        return [1, 2, 3]

    def decode(self, tokens):
        return " ".join(map(str, tokens))

    def run(self, reqs, schedule):
        from types import SimpleNamespace

        from divergence.core.events import TARGET, SeqSlice, StepEvent, StepPlan

        outs = {}
        for r in reqs:
            toks = [5, 6, 7, 8][: r.max_tokens]
            if r.id.startswith("n") and r.arrival % 3 == 1:
                toks = [5, 6, 9, 8]
            outs[r.id] = SimpleNamespace(tokens=toks, text=self.decode(toks))
        plan = StepPlan(0, TARGET, tuple(SeqSlice(r.id, "decode", 0, 1, i, (1,)) for i, r in enumerate(reqs)))
        for ob in self.observers:
            ob.on_step(StepEvent(plan, 0.0))
            for r in reqs:
                ob.on_request(SimpleNamespace(kind="finished", request_id=r.id))
        return SimpleNamespace(outputs=outs, target_steps=4)


def test_sweep_reports_counts_first_differences_and_batches():
    from divergence.workloads.sweep import sweep

    eng = _FakeEngine()
    done = []
    r = sweep(eng, "x", runs=30, max_batch=4, max_tokens=4, seed=3, progress=lambda i, n: done.append((i, n)))
    assert done[-1] == (30, 30) and eng.observers == []
    assert r.unique == 2 and sum(r.counts) == 30 and r.reference_tokens == [5, 6, 7, 8]
    odd = r.counts[r.diverge_at.index(2)]
    assert r.first_difference == {2: odd} and 0 < odd < 30
    assert sorted(r.diverge_at, key=str) == [2, None]
    assert r.tails[r.diverge_at.index(2)] == "5 6 9 8"  # from 4 tokens before the difference
    # one fake step holds the whole chunk: each needle saw all of its requests
    assert r.batch_sizes == [30 + r.fillers] * 30 and r.engine_runs == 1
    j = r.to_json()
    assert j["first_difference"] == {"2": odd} and j["stream"]["fillers"] == r.fillers


def test_batch_invariant_stream_gives_one_completion_in_batches_the_plan_predicted(target):
    """batch-invariant kernels: every needle of a stream of varied batches gets the text of
    the needle alone, on any CPU; and the batch each needle saw (from the run's step plans)
    is the one the planner laid out (lengths hold exactly under batch-invariant)."""
    import random

    from divergence.engine.engine import Engine
    from divergence.workloads.sweep import filler_lengths, plan_stream, sweep

    eng = Engine(target, policy="batch-invariant")
    prompt = "Return the number of"
    r = sweep(eng, prompt, runs=24, max_batch=5, max_tokens=12, seed=1)
    assert r.unique == 1 and r.counts == [24] and r.diverge_at == [None] and r.first_difference == {}
    assert r.engine_runs == 1 and r.fillers > 0 and eng.observers == []
    assert max(r.batch_sizes) <= 5 and len(set(r.batch_sizes)) >= 3
    # the planner's prediction, from the same inputs the sweep used
    needle = tuple(eng.encode(prompt))
    from divergence.core.request import Request

    life = eng.run([Request("needle", needle, max_tokens=12)], "concurrent").target_steps
    fillers = filler_lengths(eng, 12)
    (chunk,) = plan_stream(random.Random(1), 24, 5, needle, life, fillers, 12).chunks
    natural = dict(fillers)
    occ = _occupancy(chunk, life, natural)
    want = {rq.id: max(occ[c] for c in range(rq.arrival, rq.arrival + life)) for rq in chunk if rq.id.startswith("n")}
    assert r.batch_sizes == [want[f"n{i}"] for i in range(24)]


def test_native_stream_counts_every_run(target):
    from divergence.engine.engine import Engine
    from divergence.workloads.sweep import sweep

    r = sweep(Engine(target, policy="native"), "Return the number of", runs=12, max_batch=4, max_tokens=12)
    assert r.unique >= 1 and sum(r.counts) == 12 and len(r.completions) == r.unique
    assert len(r.batch_sizes) == 12 and 1 <= min(r.batch_sizes) and max(r.batch_sizes) <= 4 + 1


def test_sweep_with_max_batch_1_runs_each_needle_alone(target):
    from divergence.engine.engine import Engine
    from divergence.workloads.sweep import sweep

    r = sweep(Engine(target, policy="threshold:4"), "Return the number of", runs=5, max_batch=1, max_tokens=8)
    assert r.batch_sizes == [1] * 5 and r.fillers == 0 and r.unique == 1


def test_sweep_cli_text_names_the_stream(capsys):
    assert main(["sweep", "-n", "6", "--max-tokens", "8", "--max-batch", "3"]) == 0
    out = capsys.readouterr().out
    assert "6 runs of 'Return the number of'" in out and "one stream: 6 needles + " in out


@pytest.mark.parametrize("args, needle", [(["-n", "0"], "-n >= 1"), (["--prompt", ""], "non-empty --prompt"),
                                          (["--max-batch", "1025"], "1..1024")])
def test_sweep_bad_input_is_one_line_and_2(capsys, args, needle):
    capsys.readouterr()
    rc = main(["sweep", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and needle in err[0], err
