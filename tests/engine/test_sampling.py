"""Sampling on the device, and the step loop's overlap, against independent references.

- greedy over all rows in one graph == mlx-lm's rule applied row by row (argmax of
  row - logsumexp(row), generate_step's own expression), ties included;
- top-k on the device == a float64-free numpy reference over the full logits;
- queuing the next step before this one's tokens return (overlap, and the one-sync
  speculative round) changes nothing: every event equal to the synchronous loop's.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from divergence.core.events import Observer
from divergence.core.request import Request, Sampling
from divergence.engine import sampling as smp
from divergence.engine.engine import Engine


def _rows(dtype, rows=8, vocab=4096, seed=0, ties=True):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, vocab)).astype(np.float32) * 3
    if ties:  # exact ties at the top and values that tie only after subtracting logsumexp
        x[:, 17] = x[:, 5] = x.max(axis=1) + 1
        x[1, 300] = np.nextafter(x[1, 17], np.float32(np.inf))
    return mx.array(x).astype(dtype)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_device_greedy_is_mlx_lm_rule_row_by_row(dtype):
    for seed in range(3):
        logits = _rows(dtype, seed=seed)
        ds = smp.sample_on_device(logits, top_k=4)
        got = smp.to_host(ds).ids
        want = []
        for i in range(logits.shape[0]):  # generate_step: logits - mx.logsumexp(logits, keepdims=True)
            row = logits[i : i + 1]
            want.append(int(mx.argmax(row - mx.logsumexp(row, keepdims=True), axis=-1).item()))
        assert got.tolist() == want


@pytest.mark.parametrize("vocab", [1000, 4096])  # one partition; two stages (vocab chunks)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_device_topk_matches_numpy_and_ignores_the_batch(dtype, vocab):
    logits = _rows(dtype, rows=6, vocab=vocab, seed=3, ties=False)
    full = np.array(logits.astype(mx.float32))
    s = smp.to_host(smp.sample_on_device(logits, top_k=5))
    for i in range(full.shape[0]):
        order = sorted(range(full.shape[1]), key=lambda j: (-full[i, j], j))[:5]
        assert s.top_vals[i].view(np.uint32).tolist() == full[i, order].view(np.uint32).tolist()
        # ids: exact above the 5th value; at it (a tie across the boundary, common in bf16)
        # any of the tied ids, ascending
        kth = full[i, order[-1]]
        above = [j for j in order if full[i, j] > kth]
        assert s.top_ids[i].tolist()[: len(above)] == above
        tied = s.top_ids[i].tolist()[len(above):]
        assert tied == sorted(tied) and all(full[i, j] == kth for j in tied)
        assert s.chosen[i].view(np.uint32) == full[i, s.ids[i]].view(np.uint32)
        alone = smp.to_host(smp.sample_on_device(logits[i : i + 1], top_k=5))
        assert alone.top_ids[0].tolist() == s.top_ids[i].tolist()
        assert alone.ids[0] == s.ids[i]


def test_full_logits_only_for_sampling_rows():
    logits = _rows(mx.float32, rows=4, vocab=64, ties=False)
    s = smp.to_host(smp.sample_on_device(logits, top_k=2, full_rows=[1, 3]))
    assert sorted(s.full) == [1, 3]
    np.testing.assert_array_equal(s.logits(3), np.array(logits[3]))


def test_token_probability_is_numpys_float64_exp_of_the_difference():
    """A committed token's probability (stats_of) is np.exp(np.float64(logit) -
    np.float64(lse)), the expression traces were written with, bit for bit: large and tiny
    differences, exact zeros, an -inf logit (NaN) and a NaN lse."""
    rng = np.random.default_rng(7)
    R = 4096
    chosen = (rng.normal(size=R) * 30).astype(np.float32)
    lse = (chosen + np.abs(rng.normal(size=R)).astype(np.float32) * rng.choice([1e-6, 1e-2, 1, 40], R)).astype(np.float32)
    lse[:8] = chosen[:8]
    chosen[8], lse[9] = -np.inf, np.nan
    s = smp.Sampled(np.arange(R), chosen=chosen, lse=lse)
    greedy = Sampling()
    for r in range(R):
        logit, prob = s.stats_of(r, r, greedy)
        assert logit == float(chosen[r]) or (np.isnan(logit) and np.isnan(chosen[r]))
        want = float(np.exp(np.float64(chosen[r]) - np.float64(lse[r]))) if np.isfinite(chosen[r]) else float("nan")
        assert np.float64(prob).tobytes() == np.float64(want).tobytes(), (r, chosen[r], lse[r])


class _Events(Observer):
    wants_kv_hashes = wants_kernels = True

    def __init__(self):
        self.events = []

    def on_step(self, e):
        self.events.append(("step", e.plan))

    def on_kernel(self, c):
        self.events.append(("kernel", c))

    def on_kv_write(self, w):
        self.events.append(("kv", w.step, w.model, w.request_id, w.layer, w.start, w.count, w.k_hashes.tolist(),
                            w.v_hashes.tolist()))

    def on_token(self, t):
        self.events.append(("token", t.step, t.request_id, t.position, t.token, t.spec, t.topk_ids.tolist(),
                            t.topk_logits.view(np.uint32).tolist()))

    def on_request(self, r):
        self.events.append(("request", r.step, r.request_id, r.kind, r.detail))


def _events(target, draft, reqs, schedule, *, overlap, eos=None, **kw):
    ob = _Events()
    eng = Engine(target, draft, observers=[ob], overlap=overlap, **kw)
    if eos is not None:
        eng.eos_ids = set(eos)
    res = eng.run(reqs, schedule)
    return ob.events, {k: o.tokens for k, o in res.outputs.items()}


def _requests(target, prompts, n=4, max_tokens=10, arrivals=(0, 0, 1, 3)):
    return [Request(f"r{i}", tuple(target.encode(p)), max_tokens=max_tokens + i, arrival=arrivals[i])
            for i, p in enumerate(prompts[:n])]


@pytest.mark.parametrize("schedule", ["serial", "concurrent"])
def test_overlap_changes_nothing(target, prompts, schedule):
    reqs = _requests(target, prompts)
    base, toks = _events(target, None, reqs, schedule, overlap=False, stop_at_eos=False)
    # an EOS that some request meets mid-run: the step queued ahead of it must be rebuilt
    eos = {toks["r1"][4]}
    for e in (None, eos):
        sync, _ = _events(target, None, reqs, schedule, overlap=False, eos=e)
        fast, _ = _events(target, None, reqs, schedule, overlap=True, eos=e)
        assert fast == sync
    assert any(ev[0] == "request" and ev[4] == "eos" for ev in fast), "the EOS case was not exercised"
    assert base != fast


def test_one_sync_speculative_round_changes_nothing(target, draft, prompts):
    reqs = _requests(target, prompts, max_tokens=12)
    sync, _ = _events(target, draft, reqs, "concurrent", overlap=False, spec_k=3, stop_at_eos=False)
    fast, _ = _events(target, draft, reqs, "concurrent", overlap=True, spec_k=3, stop_at_eos=False)
    assert fast == sync
    assert any(ev[0] == "step" and ev[1].model == "draft" and len(ev[1].slices) > 1 for ev in fast)


def test_sampled_requests_overlap_and_spec(target, draft, prompts):
    """Requests that sample take the synchronous path; greedy ones in the same run do not."""
    reqs = _requests(target, prompts, max_tokens=8)
    reqs[1] = Request("r1", reqs[1].prompt_tokens, max_tokens=8, sampling=Sampling(temperature=0.8, seed=5))
    for spec_k, d in ((0, None), (2, draft)):
        sync, _ = _events(target, d, reqs, "concurrent", overlap=False, spec_k=spec_k, stop_at_eos=False)
        fast, _ = _events(target, d, reqs, "concurrent", overlap=True, spec_k=spec_k, stop_at_eos=False)
        assert fast == sync


def test_overlap_and_spec_under_the_mlx_lm_prefill_layout(target, draft, prompts):
    reqs = _requests(target, prompts, max_tokens=8)
    for spec_k, d in ((0, None), (2, draft)):
        sync, _ = _events(target, d, reqs, "concurrent", overlap=False, spec_k=spec_k, stop_at_eos=False,
                          prefill="mlx-lm")
        fast, _ = _events(target, d, reqs, "concurrent", overlap=True, spec_k=spec_k, stop_at_eos=False,
                          prefill="mlx-lm")
        assert fast == sync


@pytest.mark.parametrize("vocab", [1000, 4096])  # one partition; two stages (vocab chunks)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_flat_gathers_read_what_take_along_axis_reads(dtype, vocab, monkeypatch):
    """On a GPU the sampler reads its values by flat gathers (no take_along_axis module to
    compile there); here, on the CPU, that path against the CPU's take_along_axis: the same
    ids, top-k, chosen logits and logsumexp, bit for bit, ties included."""
    logits = _rows(dtype, rows=5, vocab=vocab, seed=4)
    assert not smp.flat_gathers() or mx.default_device().type == mx.DeviceType.gpu
    got = {}
    for flat in (False, True):
        monkeypatch.setattr(smp, "flat_gathers", lambda flat=flat: flat)
        s = smp.to_host(smp.sample_on_device(logits, top_k=6))
        got[flat] = [s.ids, s.top_ids, s.top_vals.view(np.uint32), s.chosen.view(np.uint32), s.lse.view(np.uint32)]
    for a, b in zip(got[False], got[True]):
        assert a.tobytes() == b.tobytes()
