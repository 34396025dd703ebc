"""Native-class signatures are kept on disk per backend fingerprint: a later process reuses
them (no probe), another fingerprint, other weights or a stand-in kernel never does, and
DIVERGENCE_PROOF_CACHE=off keeps them in memory."""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from divergence.engine.kernels import backend_proofs, linear as kernels, native_classes as nc


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(backend_proofs.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(backend_proofs.OFF_ENV, raising=False)
    calls = []
    real = nc.NativeClassProbe.outputs

    def counted(self, op, m, dtype):
        calls.append((op.name, m))
        return real(self, op, m, dtype)

    monkeypatch.setattr(nc.NativeClassProbe, "outputs", counted)
    fresh_process(monkeypatch)
    return tmp_path, calls


def fresh_process(monkeypatch):
    """What a new process starts with: an empty in-memory store, read from disk on first use."""
    monkeypatch.setattr(nc, "SIGNATURES", backend_proofs.BackendStore("native-classes"))


def _op(seed: int = 3, n: int = 96, k: int = 64) -> kernels.LinearOp:
    lin = nn.Linear(k, n, bias=False)
    lin.weight = mx.random.normal((n, k), key=mx.random.key(seed)) * k ** -0.5
    return kernels.LinearOp.from_module("gate_proj", lin)


def test_a_later_process_reuses_the_stored_signature(cache, monkeypatch):
    tmp, calls = cache
    op = _op()
    first = {m: nc.NativeClassProbe(weights="w1").signature(op, m, mx.float32) for m in (1, 8)}
    assert calls == [("gate_proj", 1), ("gate_proj", 8)]
    assert list(tmp.glob("native-classes-*.json"))
    fresh_process(monkeypatch)
    calls.clear()
    again = {m: nc.NativeClassProbe(weights="w1").signature(op, m, mx.float32) for m in (1, 8)}
    assert again == first and calls == []
    # what was stored is what a probe computes
    assert nc.NativeClassProbe().signature(op, 8, mx.float32) == first[8]


def test_another_fingerprint_does_not_reuse_it(cache, monkeypatch):
    _, calls = cache
    op = _op()
    sig = nc.NativeClassProbe(weights="w1").signature(op, 8, mx.float32)
    real = backend_proofs.fingerprint
    monkeypatch.setattr(backend_proofs, "fingerprint", lambda: {**real(), "blas_core": "SomeOtherCore"})
    fresh_process(monkeypatch)
    calls.clear()
    assert nc.NativeClassProbe(weights="w1").signature(op, 8, mx.float32) == sig  # same backend bits here
    assert calls == [("gate_proj", 8)]  # but probed again, not read from the other fingerprint's file


def test_other_weights_are_probed_again(cache, monkeypatch):
    _, calls = cache
    a = nc.NativeClassProbe(weights="w1").signature(_op(seed=3), 8, mx.float32)
    fresh_process(monkeypatch)
    calls.clear()
    b = nc.NativeClassProbe(weights="w1").signature(_op(seed=4), 8, mx.float32)  # same file hash, other rows
    assert calls == [("gate_proj", 8)] and a != b
    calls.clear()
    nc.NativeClassProbe(weights="w2").signature(_op(seed=3), 8, mx.float32)
    assert calls == [("gate_proj", 8)]


def test_a_stand_in_kernel_is_never_stored(cache, monkeypatch):
    tmp, calls = cache
    op = _op()
    real = kernels.run_native
    monkeypatch.setattr(kernels, "run_native", lambda x, o: real(x, o) * 2)
    stand_in = nc.NativeClassProbe(weights="w1").signature(op, 8, mx.float32)
    assert not list(tmp.glob("native-classes-*.json"))
    monkeypatch.setattr(kernels, "run_native", real)
    fresh_process(monkeypatch)
    calls.clear()
    own = nc.NativeClassProbe(weights="w1").signature(op, 8, mx.float32)
    assert calls == [("gate_proj", 8)] and own != stand_in


def test_off_keeps_signatures_in_memory(cache, monkeypatch):
    tmp, calls = cache
    monkeypatch.setenv(backend_proofs.OFF_ENV, "off")
    nc.NativeClassProbe(weights="w1").signature(_op(), 8, mx.float32)
    assert not list(tmp.glob("native-classes-*.json"))
    fresh_process(monkeypatch)
    calls.clear()
    nc.NativeClassProbe(weights="w1").signature(_op(), 8, mx.float32)
    assert calls == [("gate_proj", 8)]


def test_attention_signatures_are_stored_too(cache, monkeypatch):
    _, _ = cache
    sig = nc.AttentionClassProbe().signature("batched", 4, 4, 2, 32, 1, mx.float32)
    fresh_process(monkeypatch)
    monkeypatch.setattr(nc.AttentionClassProbe, "outputs", lambda *a, **k: pytest.fail("probed again"))
    assert nc.AttentionClassProbe().signature("batched", 4, 4, 2, 32, 1, mx.float32) == sig
