"""Attention as a dispatched op: `per-seq` and `batched` against a float64 numpy
reference, bitwise against each other where this CPU makes them equal, chosen and
recorded by the policy, forcible per step."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from divergence.core.events import DECODE, PREFILL, VERIFY, Observer, SeqSlice, StepPlan
from divergence.core.policy import KernelPolicy
from divergence.core.request import Request
from divergence.engine.kernels import attention
from divergence.engine.kernels.dispatch import KernelDispatcher
from divergence.engine.engine import Engine
from divergence.engine.model.kv_cache import PagedKVCache
from divergence.engine.sched.blocks import BlockManager
from divergence.engine.kernels.read_rows import CUDNN_ROWS, batched_blocks
from divergence.engine.model.prepared import prepare_step

H, KV, HD, BS = 4, 2, 32, 16
ON_CPU = mx.default_device() == mx.cpu


def _step(slices_spec, dtype, seed=0, num_blocks=64):
    """A cache holding random K/V for each sequence, a plan of the given slices
    (phase, start, count), and random queries for the step's rows."""
    rng = np.random.default_rng(seed)
    blocks = BlockManager(num_blocks, BS)
    cache = PagedKVCache(1, num_blocks, BS, KV, HD, dtype)
    slices, row = [], 0
    ks, vs = {}, {}
    for i, (phase, start, count) in enumerate(slices_spec):
        rid = f"r{i}"
        end = start + count
        blocks.allocate(rid, end + 5)
        k = rng.standard_normal((end, KV, HD)).astype(np.float32)
        v = rng.standard_normal((end, KV, HD)).astype(np.float32)
        cache.write(0, mx.array(blocks.slots(rid, 0, end)), mx.array(k).astype(dtype), mx.array(v).astype(dtype))
        ks[rid], vs[rid] = k, v
        slices.append(SeqSlice(rid, phase, start, count, row, tuple(range(count)), tuple(range(count))))
        row += count
    q = mx.array(rng.standard_normal((row, H, 1, HD)).astype(np.float32)).astype(dtype)
    mx.eval(cache.arrays())
    return StepPlan(0, "target", tuple(slices)), blocks, cache, q


def _reference(plan, blocks, cache, q):
    """float64 attention of every row over its own sequence's cached K/V."""
    out = []
    qn = np.asarray(q.astype(mx.float32), np.float64)[:, :, 0]
    for s in plan.slices:
        k, v = cache.read(0, mx.array(blocks.slots(s.request_id, 0, s.start + s.count)))
        k = np.asarray(k.astype(mx.float32), np.float64)
        v = np.asarray(v.astype(mx.float32), np.float64)
        for r in range(s.count):
            L = s.start + r + 1
            qr = qn[s.row_offset + r]  # [H, HD]
            kk = np.repeat(k[:L], H // KV, axis=1)  # [L, H, HD]
            vv = np.repeat(v[:L], H // KV, axis=1)
            sc = np.einsum("hd,lhd->hl", qr, kk) * HD ** -0.5
            p = np.exp(sc - sc.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            out.append(np.einsum("hl,lhd->hd", p, vv).reshape(-1))
    return np.stack(out)


def _run(kernel, plan, blocks, cache, q):
    prep = prepare_step(plan, blocks, kernel)
    real = prep.real_rows
    if real is not None:  # `padded` laid the rows out padded: the queries go there, the plan's rows come back
        qp = mx.zeros((prep.rows,) + q.shape[1:], dtype=q.dtype)
        qp[real] = q
        q = qp
    out = attention.attend(prep, 0, q, cache, HD ** -0.5)
    out = out if real is None else out[real]
    mx.eval(out)
    return prep, out


def _bits(a):
    return np.asarray(a.view(mx.uint16 if a.dtype.size == 2 else mx.uint32))


DECODES = [(DECODE, 4, 1), (DECODE, 40, 1), (DECODE, 17, 1), (DECODE, 0, 1), (DECODE, 63, 1)]
VERIFIES = [(VERIFY, 9, 4), (VERIFY, 30, 4), (VERIFY, 2, 3), (DECODE, 50, 1)]
MIXED = [(DECODE, 21, 1), (PREFILL, 0, 12), (VERIFY, 33, 4), (PREFILL, 16, 9), (DECODE, 5, 1)]
EQUAL = [(DECODE, 37, 1)] * 4  # equal prompts decoding together: the mask masks nothing


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("spec", [DECODES, VERIFIES, MIXED, EQUAL], ids=["decode", "verify", "mixed", "equal"])
def test_both_kernels_match_a_float64_reference(dtype, spec):
    plan, blocks, cache, q = _step(spec, dtype)
    ref = _reference(plan, blocks, cache, q)
    tol = 1e-5 if dtype == mx.float32 else 3e-2  # bf16 keeps 8 bits of mantissa
    for kernel in ("per-seq", "batched", "padded"):
        prep, out = _run(kernel, plan, blocks, cache, q)
        assert prep.kernel == kernel
        got = np.asarray(out.astype(mx.float32), np.float64)
        assert got.shape == ref.shape
        err = np.abs(got - ref).max()
        assert err <= tol * max(1.0, np.abs(ref).max()), (kernel, err)


# lengths whose blocks fill a multiple of 256 rows, and their neighbours
AT_256 = [(DECODE, 255, 1), (DECODE, 250, 1), (DECODE, 511, 1), (DECODE, 300, 1)]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("spec", [AT_256, [(DECODE, 255, 1)] * 3, AT_256[:2] + [(VERIFY, 508, 4), (PREFILL, 0, 9)]],
                         ids=["decode", "equal", "mixed"])
def test_batched_reads_never_span_a_multiple_of_256_rows(dtype, spec):
    """MLX CUDA picks cuDNN for a one-row SDPA over such a buffer only when the allocator's
    buffer is exactly its size, a choice that follows the allocation history (the same step
    gave other bits run after run on the H200): the batched calls' K/V never have such rows,
    and still give the float64 reference's values."""
    plan, blocks, cache, q = _step(spec, dtype, num_blocks=160)
    prep, out = _run("batched", plan, blocks, cache, q)
    g = prep.groups[0]
    assert g.batched and (g.tables.shape[1] * BS) % CUDNN_ROWS != 0
    assert g.tables.shape[1] * BS >= g.length
    ref = _reference(plan, blocks, cache, q)
    got = np.asarray(out.astype(mx.float32), np.float64)
    tol = 1e-5 if dtype == mx.float32 else 3e-2
    assert np.abs(got - ref).max() <= tol * max(1.0, np.abs(ref).max())


@pytest.mark.parametrize("block_size", [1, 16, 24, 100])
def test_batched_blocks(block_size):
    for L in range(1, 1100):
        nb = batched_blocks(L, block_size)
        assert nb * block_size >= L and (nb * block_size) % CUDNN_ROWS != 0
        assert nb - -(-L // block_size) in (0, 1)  # at most one block more than the length needs


class _AsOnGpu:
    """attention's `mx` as on a GPU: one-row calls take the GPU's reads (mlxlm_reads or
    stable_reads), which this CPU's SDPA then runs."""

    def __getattr__(self, name):
        return getattr(mx, name)

    @staticmethod
    def default_device():
        return mx.gpu


def test_one_row_reads_follow_the_run_policy():
    """batch-invariant and gemv promise a sequence's bits whatever the batch: their one-row
    calls read the layout whose kernel is the same every run; the other policies read
    mlx-lm's, generate_step's numbers."""
    for name, onerow in (("batch-invariant", attention.STABLE), ("gemv", attention.STABLE),
                         ("native", attention.MLXLM), ("per-seq", attention.MLXLM), ("gemm", attention.MLXLM),
                         ("batched", attention.MLXLM)):
        assert KernelDispatcher(KernelPolicy.parse(name), "target")._onerow == onerow, name


@pytest.mark.skipif(not ON_CPU, reason="runs the GPU's reads through this CPU's SDPA")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_stable_one_row_reads(monkeypatch, dtype):
    """stable_reads: from 256 positions K/V gathered into batched_blocks' rows (never a multiple
    of 256, so MLX CUDA's one-row SDPA always takes its vector kernel), below that the pool's
    slice; the float64 reference's values, and on the CPU (which reads any layout alike) the
    bits of mlx-lm's layout."""
    spec = [(DECODE, 255, 1), (DECODE, 250, 1), (DECODE, 511, 1), (DECODE, 300, 1), (DECODE, 40, 1)]
    plan, blocks, cache, q = _step(spec, dtype, num_blocks=160)
    prep = prepare_step(plan, blocks, "per-seq")
    widths = []
    real_gather_batch = cache.gather_batch
    monkeypatch.setattr(cache, "gather_batch", lambda layer, t, n: widths.append((t.shape[1], n)) or
                        real_gather_batch(layer, t, n))
    monkeypatch.setattr(attention, "mx", _AsOnGpu())
    stable = attention.attend(prep, 0, q, cache, HD ** -0.5, attention.STABLE)
    assert [n for _, n in widths] == [s.start + 1 for s in plan.slices if s.start + 1 >= attention.KV_STEP]
    assert all((nb * BS) % CUDNN_ROWS != 0 and nb * BS >= n for nb, n in widths)
    mlxlm = attention.attend(prep, 0, q, cache, HD ** -0.5, attention.MLXLM)
    ref = _reference(plan, blocks, cache, q)
    tol = 1e-5 if dtype == mx.float32 else 3e-2
    assert np.abs(np.asarray(stable.astype(mx.float32), np.float64) - ref).max() <= tol * max(1.0, np.abs(ref).max())
    assert np.array_equal(_bits(stable), _bits(mlxlm))


@pytest.mark.skipif(not ON_CPU, reason="the CPU's SDPA: on MLX CUDA the rows choose the kernel (test_cuda.py)")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_cpu_batched_sdpa_reads_any_rows_alike(dtype):
    """What lets the batched layout take a block more on the CPU with no change to a trace:
    the same K/V in a 256-row and in a 272-row buffer give the same bits."""
    rng = np.random.default_rng(3)
    B = 3
    k, v = (mx.array(rng.standard_normal((B, KV, 272, HD)).astype(np.float32)).astype(dtype) for _ in "kv")
    q = mx.array(rng.standard_normal((B, H, 1, HD)).astype(np.float32)).astype(dtype)
    k256, v256 = mx.contiguous(k[:, :, :256]), mx.contiguous(v[:, :, :256])  # the same rows, a 256-row buffer
    for n in (250, 256):
        mask = mx.array(np.arange(n)[None, None, None, :] < np.array([n, n - 7, n - 100])[:, None, None, None])
        for m in (None, mask):
            a = attention.run_batched(q, k256[:, :, :n], v256[:, :, :n], m, HD ** -0.5)
            b = attention.run_batched(q, k[:, :, :n], v[:, :, :n], m, HD ** -0.5)
            assert np.array_equal(_bits(a), _bits(b)), (n, m is None)


@pytest.mark.blas
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_batched_decode_equals_per_seq_bitwise_where_the_probe_says_so(dtype):
    """One-row queries in one masked (or unmasked) SDPA: per-sequence bits or not is a fact of
    the backend (Haswell kernels and bf16: equal; fp32 under SkylakeX / Cooperlake kernels: not),
    so the engine's attention probe (native_classes.AttentionClassProbe, what a trace records)
    says which, and the step's two kernels must agree with it, on every backend."""
    from divergence.core.names import BATCHED, PER_SEQ
    from divergence.engine.kernels.native_classes import AttentionClassProbe
    from divergence.engine.model.prepared import BatchedAttention

    probe = AttentionClassProbe()
    verdicts = []
    for spec in (DECODES, EQUAL):
        plan, blocks, cache, q = _step(spec, dtype, seed=3)
        _, a = _run("per-seq", plan, blocks, cache, q)
        prep, b = _run("batched", plan, blocks, cache, q)
        layout = next(g.layout for g in prep.groups if isinstance(g, BatchedAttention))
        alike = probe.signature(BATCHED, len(spec), H, KV, HD, 1, dtype, layout=layout) == \
            probe.signature(PER_SEQ, 1, H, KV, HD, 1, dtype)
        assert np.array_equal(_bits(a), _bits(b)) == alike, (spec, layout, alike)
        verdicts.append(alike)
    if ON_CPU and dtype == mx.bfloat16:
        assert all(verdicts)  # MLX's own bf16 CPU path is not the BLAS: batch-invariant on every core


def test_batched_call_is_unmasked_only_when_the_mask_masks_nothing():
    for spec, masked in ((EQUAL, False), (DECODES, True), (VERIFIES, True)):
        plan, blocks, _, _ = _step(spec, mx.float32)
        g = prepare_step(plan, blocks, "batched").groups[0]
        assert (g.mask is not None) == masked, spec


def test_padded_puts_every_slice_in_one_masked_call():
    """`padded` (BatchGenerator's calls): prefill slices join too, and the mask stays even
    where it masks nothing."""
    plan, blocks, _, _ = _step(MIXED, mx.float32)
    prep = prepare_step(plan, blocks, "padded")
    assert [type(g).__name__ for g in prep.groups] == ["BatchedAttention"] and prep.batch == len(MIXED)
    assert prep.groups[0].queries == 12 and prep.groups[0].mask is not None
    plan, blocks, _, _ = _step(EQUAL, mx.float32)
    assert prepare_step(plan, blocks, "padded").groups[0].mask is not None
    assert KernelPolicy.parse("padded").attention_kernel(0) == "padded"  # prefill-only steps too
    # decode steps of unequal lengths read K/V left-padded, as BatchGenerator's cache holds them
    plan, blocks, _, _ = _step(DECODES, mx.float32)
    g = prepare_step(plan, blocks, "padded").groups[0]
    L = g.length
    assert g.left_slots is not None and g.left_slots.shape == (len(DECODES) * L,)
    first = plan.slices[3]  # (DECODE, 0, 1): one position, right-aligned
    row = np.asarray(g.left_slots).reshape(len(DECODES), L)[3]
    assert (row[:-1] == blocks.num_blocks * BS).all() and row[-1] == blocks.slots(first.request_id, 0, 1)[0]
    assert np.asarray(g.mask)[3, 0, 0].tolist() == [False] * (L - 1) + [True]


def test_a_step_records_the_class_of_its_calls_layout():
    """The recorded native class is the probe's for the layout the call had: a padded decode
    of unequal lengths is left-padded, an equal-length batched decode unmasked."""
    for spec, kernel, layout in ((DECODES, "padded", "left"), (DECODES, "batched", "right"),
                                 (EQUAL, "batched", "equal")):
        plan, blocks, cache, q = _step(spec, mx.float32)
        seen = []
        disp = KernelDispatcher(KernelPolicy.parse(kernel), "target", emit=seen.append)
        disp.begin_step(0)
        prep = prepare_step(plan, blocks, kernel)
        mx.eval(disp.attend(prep, 0, q, cache, HD ** -0.5))
        want = disp.attention_classes.signature("batched", len(spec), H, KV, HD, 1, q.dtype, layout=layout)
        assert [c.native_class for c in seen] == [want], (kernel, layout)


def test_padded_lays_rows_out_as_a_right_padded_batch():
    """Slices of different lengths under `padded`: T = B x longest rows, each slice at b * n,
    pad rows token 0 writing to the cache's spare block, logit rows and real rows mapped."""
    plan, blocks, cache, _ = _step(MIXED, mx.float32)
    prep = prepare_step(plan, blocks, "padded")
    n, B = max(s.count for s in plan.slices), len(plan.slices)
    assert prep.rows == B * n and prep.groups[0].q_index is not None
    real = np.asarray(prep.real_rows)
    assert real.tolist() == [b * n + r for b, s in enumerate(plan.slices) for r in range(s.count)]
    slots, toks = np.asarray(prep.write_slots), np.asarray(prep.tokens)
    pad = np.setdiff1d(np.arange(B * n), real)
    assert (slots[pad] == blocks.num_blocks * BS).all() and (toks[pad] == 0).all()
    assert cache.k[0].shape[2] >= (blocks.num_blocks + 1) * BS  # the spare block exists
    assert np.asarray(prep.logit_index).tolist() == [b * n + lr for b, s in enumerate(plan.slices)
                                                     for lr in s.logit_rows]


def test_batched_groups_every_decode_slice_in_one_call():
    plan, blocks, _, _ = _step(MIXED, mx.float32)
    prep = prepare_step(plan, blocks, "batched")
    assert prep.batch == 3 and prep.kernel == "batched"
    kinds = [type(g).__name__ for g in prep.groups]
    assert kinds == ["BatchedAttention", "SeqAttention", "SeqAttention"]
    assert prep.groups[0].queries == 4 and prep.groups[0].length == 37
    assert prep.out_perm is not None  # rows come back in the step's order
    assert prepare_step(plan, blocks, "per-seq").groups[0].__class__.__name__ == "SeqAttention"


@pytest.mark.parametrize("policy,decodes,kernel", [
    ("native", 1, "per-seq"), ("native", 2, "batched"), ("native", 0, "per-seq"),
    ("threshold:4", 8, "batched"), ("gemm", 3, "batched"),
    ("batch-invariant", 8, "per-seq"), ("gemv", 8, "per-seq"),
    ("per-seq", 8, "per-seq"), ("batched", 1, "batched"),
])
def test_policy_attention_kernel(policy, decodes, kernel):
    assert KernelPolicy.parse(policy).attention_kernel(decodes) == kernel


def test_attention_only_policies_leave_linear_ops_native():
    assert KernelPolicy.parse("per-seq").kernel_for(7) == "native"
    assert KernelPolicy.parse("batched").kernel_for(1) == "native"


def test_forcing_attention_per_step():
    d = KernelDispatcher(KernelPolicy.parse("native"), "target")
    d.forced = {3: {"attention": KernelPolicy.parse("per-seq")}, 4: KernelPolicy.parse("batch-invariant")}
    assert [d.attention_kernel(s, 4) for s in (2, 3, 4, 5)] == ["batched", "per-seq", "per-seq", "batched"]


class Kernels(Observer):
    wants_kernels = True

    def __init__(self):
        self.choices = []

    def on_kernel(self, c):
        self.choices.append(c)


def test_engine_records_attention_per_step_and_layer(target, prompts):
    obs = Kernels()
    eng = Engine(target, policy="native", stop_at_eos=False, observers=[obs])
    reqs = [Request(f"r{i}", tuple(target.encode(p)), max_tokens=6) for i, p in enumerate(prompts[:4])]
    eng.run(reqs, "concurrent")
    att = [c for c in obs.choices if c.op == "attention"]
    steps = {c.step for c in obs.choices}
    assert {(c.step, c.layer) for c in att} == {(s, li) for s in steps for li in range(target.num_layers)}
    batched = [c for c in att if c.kernel == "batched"]
    assert batched and all(c.n >= 2 and c.k >= c.kv_min > 0 and c.native_class for c in batched)
    # on this CPU (bf16) a batched decode computes every probe row as the sequences alone do
    fwd = eng._target_fwd
    alone = fwd.attention_classes.signature("per-seq", 1, fwd.n_heads, fwd.n_kv_heads, fwd.head_dim, 1, fwd.dtype)
    obs.choices.clear()
    eng.run(reqs[:1], "serial")  # one sequence: per-seq, class of the sequence alone
    assert {c.native_class for c in obs.choices if c.op == "attention" and c.native_class} == {alone}
    assert {c.kernel for c in obs.choices if c.op == "attention"} == {"per-seq"}
    if ON_CPU:
        assert {c.native_class for c in batched} == {alone}


def test_batch_invariant_serial_equals_concurrent_with_spec_and_prefix_cache(target, draft):
    """Per-seq attention under batch-invariant: serial and concurrent agree bit for bit with
    speculative decoding and prefix caching both on (shared prefixes, staggered arrivals)."""
    from divergence.workloads.prompts import DEMO_R2_PROMPT

    base = target.encode(DEMO_R2_PROMPT)
    reqs = [Request(f"r{i}", tuple(base[: 36 + 7 * i]), max_tokens=10, arrival=i) for i in range(4)]
    obs = Kernels()
    eng = Engine(target, draft, policy="batch-invariant", spec_k=3, prefix_caching=True, stop_at_eos=False,
                 observers=[obs])
    s = eng.run(reqs, "serial")
    c = eng.run(reqs, "concurrent")
    assert c.prefix_hits > 0 and s.prefix_hits > 0
    assert {x.kernel for x in obs.choices if x.op == "attention"} == {"per-seq"}
    for r in reqs:
        a, b = s.outputs[r.id], c.outputs[r.id]
        assert a.tokens == b.tokens
        assert np.array_equal(np.array(a.topk_logits).view(np.uint32), np.array(b.topk_logits).view(np.uint32))


def test_probe_reports_attention_classes_by_layout_and_batch(monkeypatch):
    from divergence.workloads.probe import probe_attention

    for layout in ("right", "left"):
        got = probe_attention(H, KV, HD, mx.bfloat16, [1, 2, 3, 8], 1, layout)
        if ON_CPU:  # one-row queries: every batch computes each sequence as alone
            assert got == [0, 0, 0, 0]
    # a backend whose batched kernel reduces over the keys another way: batches >= 2 differ
    monkeypatch.setattr(attention, "run_batched",
                        lambda q, k, v, mask, scale: attention.sdpa(q, k[:, :, ::-1], v[:, :, ::-1], scale=scale,
                                                                    mask=mask[..., ::-1]))
    got = probe_attention(H, KV, HD, mx.float32, [1, 2, 8], 1, "right")
    assert got[1] != 0 and got[2] != 0


def _two_prefills(fwd, **kw):
    """One native step of two prefill slices (5 and 3 rows) on a fresh cache."""
    blocks = BlockManager(16, BS)
    cache = fwd.make_cache(16, BS)
    disp = KernelDispatcher(KernelPolicy.parse("native"), "target")
    for rid in ("a", "b"):
        blocks.allocate(rid, 40)
    plan = StepPlan(0, "target", (SeqSlice("a", PREFILL, 0, 5, 0, (1, 2, 3, 4, 5), (4,)),
                                  SeqSlice("b", PREFILL, 0, 3, 5, (6, 7, 8), (2,))))
    return fwd(plan, cache, blocks, disp, **kw)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tap_sees_every_op_in_forward_order_and_changes_nothing(random_model, family):
    from divergence.core.names import TAP_POINTS
    from divergence.engine.model.forward import PackedForward

    loaded = random_model(family, hidden_size=64)
    fwd = PackedForward(loaded)
    seen = []
    outs = []
    for tap in (None, lambda layer, point, rows: seen.append((layer, point, rows.shape[0]))):
        out = _two_prefills(fwd, tap=tap)
        mx.eval(out.logits)
        outs.append(_bits(out.logits))
    assert np.array_equal(outs[0], outs[1])
    layer_points = [p for p in TAP_POINTS if p not in ("norm", "lm_head")]
    if family != "qwen3":
        layer_points = [p for p in layer_points if p not in ("q_norm", "k_norm")]
    want = [(li, p, 8) for li in range(fwd.num_layers) for p in layer_points]
    want += [(fwd.num_layers, "norm", 2), (fwd.num_layers, "lm_head", 2)]
    assert seen == want


def test_slice_by_slice_rope_equals_the_one_call_rope(random_model):
    """RoPE modules that read the offset as a number (dynamic NTK) go slice by slice:
    on a plain RoPE both paths give the same bits."""
    from divergence.engine.model.forward import PackedForward

    loaded = random_model("llama", hidden_size=64)
    fwd = PackedForward(loaded)
    assert fwd.vector_rope
    got = []
    for vector in (True, False):
        fwd.vector_rope = vector
        out = _two_prefills(fwd, keep_kv=True)
        mx.eval(out.logits, out.k_written)
        got.append((_bits(out.logits), _bits(out.k_written)))
    assert all(np.array_equal(a, b) for a, b in zip(*got))


@pytest.mark.parametrize("block_size", [16, 12])  # 12 does not divide mlx-lm's 256-position steps
@pytest.mark.parametrize("consecutive", [True, False])
@pytest.mark.parametrize("length", [1, 255, 256, 257, 300, 512, 513])
def test_mlxlm_reads_keep_the_values(length, consecutive, block_size):
    """mlxlm_reads (a one-row query's K/V on the GPU, in mlx-lm's buffer layout) reads the
    values the plain gather reads, whatever the length against mlx-lm's 256-position
    buffer steps, the blocks' order in the pool and a block size that does not divide 256;
    the buffer's rows past the sequence (other blocks' K/V) are not part of it."""
    from divergence.engine.kernels.attention import mlxlm_reads
    from divergence.engine.model.kv_cache import PagedKVCache
    from divergence.engine.model.prepared import SeqAttention

    nb = -(-length // block_size)
    cache = PagedKVCache(2, 2 * (-(-768 // block_size)), block_size, 2, 16, mx.bfloat16)
    for layer in range(2):
        cache.k[layer] = mx.random.normal(cache.k[layer].shape).astype(mx.bfloat16)
        cache.v[layer] = mx.random.normal(cache.v[layer].shape).astype(mx.bfloat16)
    ids = list(range(3, 3 + nb)) if consecutive else [3 + 2 * b for b in range(nb)][::-1]
    g = SeqAttention(0, 1, length, mx.array(ids, dtype=mx.int32), ids[0] * block_size if consecutive else None, ids)
    for layer in range(2):
        k, v = mlxlm_reads(g, layer, cache)
        k0, v0 = cache.gather(layer, g.table, length)
        assert k.shape == k0.shape == (1, 2, length, 16) and k.dtype == mx.bfloat16
        assert mx.array_equal(k, k0).item() and mx.array_equal(v, v0).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 6, 5])  # rows of 8-byte words, of 4-byte words, of neither
def test_block_gather_moves_words_with_the_same_bits(dtype, head_dim):
    """gather_batch reads the pool as 8- or 4-byte words where a row allows (kv_reads.as_words):
    the same bits as indexing the pool's own elements, -0.0 and NaN payloads included."""
    from divergence.engine.kernels.kv_reads import as_words
    from divergence.engine.model.kv_cache import PagedKVCache

    cache = PagedKVCache(1, 12, 4, 2, head_dim, dtype)
    cache.k[0] = mx.random.normal(cache.k[0].shape).astype(dtype)
    cache.v[0] = mx.where(mx.random.uniform(shape=cache.v[0].shape) < 0.1, mx.array(float("nan"), dtype),
                          -mx.zeros(cache.v[0].shape, dtype))
    tables = mx.array([[3, 7, 1], [0, 12, 5]], dtype=mx.int32)
    k, v = cache.gather_batch(0, tables, 10)
    for got, pool in ((k, cache.k[0]), (v, cache.v[0])):
        want = pool[0].reshape(2, 13, 4, head_dim)[:, tables].transpose(1, 0, 2, 3, 4).reshape(2, 2, 12, head_dim)[:, :, :10]
        assert got.shape == want.shape and got.dtype == dtype
        assert np.array_equal(np.array(got.view(mx.uint8)), np.array(want.view(mx.uint8)))
    words = as_words(cache.k[0])
    assert words.dtype.size == (8 if head_dim * dtype.size % 8 == 0 else 4 if head_dim * dtype.size % 4 == 0 else dtype.size)
