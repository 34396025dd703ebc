"""Attention as the root cause: on a backend whose masked batched SDPA reduces over
the keys in another order than a single sequence's (as MLX CUDA's unfused masked path
does vs its vector kernel), the linear ops stay batch-invariant and bisect must name
`attention` (per-seq in serial, batched in concurrent), and replaying that step with
`attention=per-seq` must give serial's bits.

The stand-in batched kernel is flash-decoding's split-KV reduction: softmax over each
half of the keys, combined with the halves' max and sum.
"""
from __future__ import annotations

import json

import mlx.core as mx
import pytest

from divergence.cli.main import main
from divergence.engine.kernels import attention


def _split_kv(q, k, v, mask, scale):
    rep = q.shape[1] // k.shape[1]
    k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
    s = (q * scale) @ k.swapaxes(-1, -2)
    s = mx.where(mask, s.astype(mx.float32), -mx.inf)
    half = s.shape[-1] // 2 or 1
    parts = []
    for lo, hi in ((0, half), (half, s.shape[-1])):
        if hi <= lo:
            continue
        sp = s[..., lo:hi]
        m = mx.max(sp, axis=-1, keepdims=True)
        m = mx.where(mx.isinf(m), 0, m)
        p = mx.exp(sp - m)
        parts.append((m, p.sum(axis=-1, keepdims=True), p @ v[..., lo:hi, :].astype(mx.float32)))
    m = parts[0][0] if len(parts) == 1 else mx.maximum(parts[0][0], parts[1][0])
    num = sum(mx.exp(pm - m) * po for pm, _, po in parts)
    den = sum(mx.exp(pm - m) * ps for pm, ps, _ in parts)
    return (num / den).astype(q.dtype)


@pytest.fixture(scope="module")
def split_kv_traces(tmp_path_factory):
    from divergence.testing.models import make_random_model

    # random weights: near-tied logits, so a last-bit difference flips a token within 24
    model = make_random_model(tmp_path_factory.mktemp("rand"), hidden_size=64, num_layers=2)
    mp = pytest.MonkeyPatch()
    mp.setattr(attention, "run_batched", _split_kv)
    out = tmp_path_factory.mktemp("attn")
    try:
        assert main(["run", "--model", str(model), "--max-tokens", "24", "--out", str(out), "--json"]) in (0, 1)
        yield out, mp
    finally:
        mp.undo()


def test_bisect_names_attention_and_replay_confirms(split_kv_traces, capsys):
    out, _ = split_kv_traces
    capsys.readouterr()
    rc = main(["bisect", str(out / "serial.h5"), str(out / "concurrent.h5"), "--confirm", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 1
    causes = [r["root_cause"] for r in report["requests"] if r["root_cause"]]
    assert causes, "the split-KV batched kernel changed no bits"
    named = [c for c in causes if c["op"] == "attention"]
    assert named, [c["op"] for c in causes]
    c = named[0]
    assert (c["kernel_a"], c["kernel_b"]) == ("per-seq", "batched")
    assert c["native_class_changes"] == {}  # every linear op computed its rows as in serial
    confirmed = [r for r in report["requests"] if r["root_cause"] and r["root_cause"]["op"] == "attention"]
    assert any(r["confirmed"] for r in confirmed), [r["root_cause"]["confirm_detail"] for r in confirmed]


def test_replay_force_attention_per_seq(split_kv_traces, capsys):
    out, _ = split_kv_traces
    from divergence import Trace

    with Trace.open(out / "concurrent.h5") as t:
        ks = t.kernels()
        att = ks["op"] == "attention"
        step = int(ks["step"][att & (ks["kernel"] == "batched")][0])
    capsys.readouterr()
    rc = main(["replay", str(out / "concurrent.h5"), "--force", f"{step}:attention=per-seq",
               "--out", str(out / "forced.h5"), "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc in (0, 1)
    assert rep["forced"] == {str(step): "attention=per-seq"}
    with Trace.open(out / "forced.h5") as t:
        ks = t.kernels(step=step)
        assert set(ks["kernel"][ks["op"] == "attention"]) == {"per-seq"}
    assert rep["kv_equal"] is False  # that step's writes now differ from the batched recording
