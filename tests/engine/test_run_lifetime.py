"""A finished run is freed when its last reference goes, not by the cyclic GC."""
from __future__ import annotations

import gc

from divergence.core.events import Observer
from divergence.core.request import Request
from divergence.engine.engine import Engine
from divergence.engine.run import Run


class _Everything(Observer):
    wants_kernels = wants_kv_hashes = wants_routing = True

    def __init__(self):
        self.kernels = 0

    def on_kernels(self, events):
        self.kernels += len(events)


def _runs_alive() -> int:
    return sum(isinstance(o, Run) for o in gc.get_objects())


def test_a_traced_run_is_not_cyclic_garbage(target, prompts):
    """The dispatchers' kernel events reach the Run through a sink that does not hold it: a
    bound method had made every traced Run (and its KV cache) cyclic garbage, left to a full
    collection (25-50 ms beside a fixture run)."""
    seen = _Everything()
    eng = Engine(target, policy="native", stop_at_eos=False, observers=[seen])
    reqs = [Request(f"r{i}", target.encode(p), max_tokens=4) for i, p in enumerate(prompts[:3])]
    gc.collect()
    before = _runs_alive()
    gc.disable()
    try:
        eng.run(reqs, "concurrent")
        left = _runs_alive() - before
    finally:
        gc.enable()
    assert seen.kernels > 0, "no kernel events: the run recorded nothing, so the test proves nothing"
    assert left == 0
