"""A run whose native-class signatures come from the user cache dir records the same
kernels table, signatures included, as one that probes them: the cache changes no trace."""
from __future__ import annotations

import numpy as np

from divergence import Trace
from divergence.core.request import Request
from divergence.engine.engine import Engine
from divergence.engine.kernels import backend_proofs, native_classes
from divergence.engine.model.loading import load_model
from divergence.fixtures import TARGET
from divergence.trace.writer import TraceWriter


def traced(path, monkeypatch, cache: str):
    monkeypatch.setenv(backend_proofs.OFF_ENV, cache)
    monkeypatch.setattr(native_classes, "SIGNATURES", backend_proofs.BackendStore("native-classes"))  # a new process
    loaded = load_model(TARGET, dtype="float32")  # its own forward: nothing memoised in memory
    reqs = [Request(f"r{i}", tuple(loaded.encode(p)), max_tokens=6, arrival=i)
            for i, p in enumerate(["Return the number of", "This module provides", "Open file and"])]
    with TraceWriter(path, top_k=8) as w:
        Engine(loaded, None, policy="native", stop_at_eos=False, observers=[w]).run(reqs, "concurrent")


def test_cached_signatures_give_the_probed_trace(tmp_path, monkeypatch):
    monkeypatch.setenv(backend_proofs.CACHE_ENV, str(tmp_path / "cache"))
    traced(tmp_path / "probed.h5", monkeypatch, "off")
    traced(tmp_path / "filled.h5", monkeypatch, "on")  # probes and stores
    assert list((tmp_path / "cache").glob("native-classes-*.json"))
    for probe in (native_classes.NativeClassProbe, native_classes.AttentionClassProbe):
        monkeypatch.setattr(probe, "outputs", lambda *a, **k: (_ for _ in ()).throw(AssertionError("probed")))
    traced(tmp_path / "cached.h5", monkeypatch, "on")  # reads them: nothing is probed
    with Trace.open(tmp_path / "probed.h5") as a:
        ka = a.kernels()
        assert (ka["native_class"] != 0).any()
        for other in ("filled.h5", "cached.h5"):
            with Trace.open(tmp_path / other) as b:
                kb = b.kernels()
                assert set(ka) == set(kb)
                assert all(np.array_equal(ka[c], kb[c]) for c in ka)
                for k in ("k_hash", "v_hash"):
                    assert np.array_equal(a.kv_hashes()[k], b.kv_hashes()[k])
