"""The compiled decode step (model/compiled_step.py) has the eager step's bits, op by op.

Two forwards of the same model decode the same sequences from the same prefill, one eager,
one compiled, fed the eager one's greedy tokens. Compared bit for bit at every step: every
tap point of every layer (the compiled segments return theirs), the logits, the K/V each
step wrote, and the kernel records the dispatcher emitted. Then whole engine runs: compiled
vs eager (tokens, top-k logits, KV hashes), and at B=1 the compiled engine vs mlx-lm's
generate_step (tokens and top-k logits).
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from divergence.core.events import DECODE, PREFILL, SeqSlice, StepPlan
from divergence.core.names import TAP_POINTS
from divergence.core.policy import KernelPolicy
from divergence.core.request import Request
from divergence.engine.engine import Engine
from divergence.engine.kernels.dispatch import KernelDispatcher
from divergence.engine.model.compiled_step import CompiledDecode
from divergence.engine.model.forward import PackedForward
from divergence.engine.sampling import float32
from divergence.engine.sched.blocks import BlockManager
from divergence.testing.models import ROPE_VARIANTS

BLOCK, BLOCKS, STEPS = 16, 64, 6


def _bits(x: mx.array) -> np.ndarray:
    """The array's bit patterns (any float dtype, bf16 included)."""
    kind = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[x.dtype.size]
    return np.array(x.view(kind) if mx.issubdtype(x.dtype, mx.floating) else x)


class _Records:
    """A dispatcher's emit with the columnar entry: every kernel record, in order."""

    def __init__(self):
        self.rows = []

    def row(self, step, fields):
        self.rows.append((step, fields))

    def __call__(self, event):
        self.rows.append(event)


def _decode(loaded, prompts, *, compiled: bool, feed=None) -> tuple[list[dict], list, CompiledDecode | None]:
    """One whole-prompt prefill (eager: several rows a sequence), then STEPS decode steps of
    every sequence; each step's taps, logits and K/V written. feed: the tokens to decode
    (default: this forward's greedy ones)."""
    fwd = PackedForward(loaded, compiled=False)
    if compiled:
        fwd.compiled = CompiledDecode(fwd, tapped=True)
    blocks, cache = BlockManager(BLOCKS, BLOCK), fwd.make_cache(BLOCKS, BLOCK)
    records = _Records()
    dispatch = KernelDispatcher(KernelPolicy.parse("native"), "target", records)
    slices, row = [], 0
    for i, p in enumerate(prompts):
        blocks.allocate(f"r{i}", len(p) + STEPS)
        slices.append(SeqSlice(f"r{i}", PREFILL, 0, len(p), row, tuple(p), (len(p) - 1,)))
        row += len(p)
    out = fwd(StepPlan(0, "target", tuple(slices)), cache, blocks, dispatch)
    tokens = np.array(mx.argmax(out.logits, axis=-1)).tolist()
    steps = []
    for s in range(1, STEPS + 1):
        if feed is not None:
            tokens = feed[s - 1]
        plan = StepPlan(s, "target", tuple(SeqSlice(f"r{i}", DECODE, len(p) + s - 1, 1, i, (tokens[i],), (0,))
                                           for i, p in enumerate(prompts)))
        taps = []
        out = fwd(plan, cache, blocks, dispatch, keep_kv=True, tap=lambda layer, point, x: taps.append((layer, point, x)))
        mx.eval(out.logits, out.k_written, out.v_written, [x for *_, x in taps])
        steps.append({"tokens": tokens, "logits": out.logits, "k": out.k_written, "v": out.v_written, "taps": taps})
        tokens = np.array(mx.argmax(out.logits, axis=-1)).tolist()
    return steps, records.rows, fwd.compiled


def _compare(loaded, prompts) -> None:
    eager, eager_records, _ = _decode(loaded, prompts, compiled=False)
    comp, comp_records, compiled = _decode(loaded, prompts, compiled=True, feed=[s["tokens"] for s in eager])
    # the decode steps ran compiled: every segment traced at this batch size
    assert {key[0] for key in compiled._traced} == set(range(compiled.fwd.num_layers + 1))
    points = set()
    for s, (e, c) in enumerate(zip(eager, comp), start=1):
        assert [(layer, p) for layer, p, _ in c["taps"]] == [(layer, p) for layer, p, _ in e["taps"]], s
        for (layer, point, x), (_, _, y) in zip(e["taps"], c["taps"]):
            assert x.dtype == y.dtype and x.shape == y.shape, (s, layer, point)
            assert np.array_equal(_bits(x), _bits(y)), f"step {s} layer {layer} {point}: compiled bits differ"
            points.add(point)
        for key in ("logits", "k", "v"):
            assert np.array_equal(_bits(e[key]), _bits(c[key])), f"step {s}: {key} differ"
    assert points >= set(TAP_POINTS) - {"q_norm", "k_norm"}, sorted(set(TAP_POINTS) - points)
    assert comp_records == eager_records  # the same kernel records, in the same order


@pytest.fixture(scope="module")
def fp32_target():
    from divergence.engine.model.loading import load_model
    from divergence.fixtures import TARGET

    return load_model(TARGET, dtype="float32")


def _prompts(loaded, n):
    return [loaded.encode(f"Compiled step prompt {i}: " + "more words " * i) for i in range(n)]


@pytest.mark.parametrize("batch", [1, 8])
def test_compiled_step_is_eager_per_op_bf16(target, batch):
    _compare(target, _prompts(target, batch))


@pytest.mark.parametrize("batch", [1, 5])
def test_compiled_step_is_eager_per_op_fp32(fp32_target, batch):
    _compare(fp32_target, _prompts(fp32_target, batch))


@pytest.mark.parametrize("batch", [1, 5])
def test_compiled_step_is_eager_per_op_4bit(target_4bit, batch):
    _compare(target_4bit, _prompts(target_4bit, batch))


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_compiled_step_is_eager_per_op_families(random_model, family):
    """qwen2: q/k/v biases; qwen3: q/k norms (their tap points compared too)."""
    loaded = random_model(family, hidden_size=64)
    _compare(loaded, _prompts(loaded, 3))


@pytest.mark.parametrize("variant", ["yarn", "traditional"])
def test_compiled_step_is_eager_per_op_rope_variants(random_model, variant):
    """RoPE modules with no shared CPU table: mx.fast.rope on the positions array inside the
    segments (a 0-d offset at one row, as the eager step's Python number)."""
    loaded = random_model("llama", hidden_size=64, extra_config=ROPE_VARIANTS[variant])
    for batch in (1, 3):
        _compare(loaded, _prompts(loaded, batch))


def test_rope_that_reads_its_offset_as_a_number_runs_eager(random_model):
    """Dynamic NTK scaling reads the offset as a number: traced, it would be a constant."""
    loaded = random_model("llama", hidden_size=64, extra_config=ROPE_VARIANTS["dynamic-ntk"])
    steps, _, compiled = _decode(loaded, _prompts(loaded, 2), compiled=True)
    assert compiled._traced == {} and len(steps) == STEPS


def _outputs(loaded, prompts, *, compiled: bool, schedule: str, prefill: str = "whole"):
    engine = Engine(loaded, policy="native", stop_at_eos=False, prefill=prefill, compiled_step=compiled)
    assert (engine._target_fwd.compiled is not None) == compiled
    reqs = [Request(f"r{i}", tuple(p), max_tokens=24) for i, p in enumerate(prompts)]
    return engine.run(reqs, schedule).outputs


@pytest.mark.parametrize("schedule", ["serial", "concurrent"])
def test_compiled_engine_runs_are_eager_runs(target, schedule):
    prompts = _prompts(target, 6)
    eager = _outputs(target, prompts, compiled=False, schedule=schedule)
    comp = _outputs(target, prompts, compiled=True, schedule=schedule)
    for rid, e in eager.items():
        c = comp[rid]
        assert c.tokens == e.tokens, rid
        assert [a.tolist() for a in c.topk_ids] == [a.tolist() for a in e.topk_ids], rid
        assert [a.view(np.uint32).tolist() for a in c.topk_logits] == [a.view(np.uint32).tolist()
                                                                       for a in e.topk_logits], rid


@pytest.mark.parametrize("which", ["bf16", "4bit"])
def test_compiled_b1_is_generate_step(target, target_4bit, which):
    """prefill="mlx-lm" (the prompt's last token in the first decode step, as generate_step
    computes it): tokens and top-k logits equal generate_step's bit for bit."""
    loaded = target if which == "bf16" else target_4bit
    for i, prompt in enumerate(_prompts(loaded, 3)):
        got = _outputs(loaded, [prompt], compiled=True, schedule="serial", prefill="mlx-lm")["r0"]
        seen = []

        class Tap:
            def __getattr__(self, name):
                return getattr(loaded.model, name)

            def __call__(self, inputs, cache=None, **kw):
                out = loaded.model(inputs, cache=cache, **kw)
                seen.append(out[:, -1, :])
                return out

        want = [int(t) for t, _ in generate_step(mx.array(prompt), Tap(), max_tokens=24)]
        assert got.tokens == want, i
        for j, row in enumerate(seen[1:25]):  # [0]: the prefill of prompt[:-1]
            ref = float32(row[0])
            order = np.lexsort((np.arange(ref.size), -ref))[: len(got.topk_ids[j])]
            assert got.topk_logits[j].view(np.uint32).tolist() == ref[order].view(np.uint32).tolist(), (i, j)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("values", ["logits", "logprobs"])
def test_compiled_sampler_is_eager(monkeypatch, dtype, values):
    """sample_on_device as one compiled graph: every array it hands on (ids, top-k columns and
    values, the chosen logit, the logsumexp, the packed rows) bit for bit the eager graph's,
    one- and two-stage top-k, k = 1 and 8, rows with ties."""
    from divergence.engine import sampling

    rng = np.random.default_rng(7)
    for rows, vocab in ((1, 1024), (8, 1024), (5, 4096), (3, 1000)):
        x = rng.standard_normal((rows, vocab)).astype(np.float32)
        x[0, [3, 700]] = x[0].max() + 1  # a tie for the top
        x[-1, :] = np.round(x[-1])  # many ties, at the k-th value too
        logits = mx.array(x).astype(getattr(mx, dtype))
        for k in (1, 8):
            got = {}
            for compiled in (False, True):
                monkeypatch.setattr(sampling, "compiled_sampler", lambda c=compiled: c)
                ds = sampling.sample_on_device(logits, top_k=k, full_rows=(0,), values=values)
                arrays = [ds.ids, *ds.top_cols, ds.top_vals, ds.chosen, ds.lse, ds.packed, ds.full]
                mx.eval(arrays)
                got[compiled] = ([_bits(a) for a in arrays], ds.chunk, sampling.to_host(ds))
            (eager, chunk_e, host_e), (comp, chunk_c, host_c) = got[False], got[True]
            assert chunk_e == chunk_c and len(eager) == len(comp)
            for i, (a, b) in enumerate(zip(eager, comp)):
                assert a.shape == b.shape and np.array_equal(a, b), (rows, vocab, k, i)
            assert np.array_equal(host_e.top_ids, host_c.top_ids) and np.array_equal(host_e.ids, host_c.ids)
