"""The sparse-vs-full replay check that tests/analysis/test_sparse_replay.py runs on every
kind of trace and tests/serve/test_sparse_live.py on a live server's."""
from __future__ import annotations

import numpy as np

from divergence import Trace
from divergence.core.events import Observer
from divergence.core.policy import SOLO


class Bits(Observer):
    """One request's bits in a replay: K/V hashes (own writes and prefix reads) and draws."""

    wants_kv_hashes = True
    wants_records = True

    def __init__(self, rid: str):
        self.rid = rid
        self.kv: list = []
        self.draws: list = []

    def on_kv_write(self, w) -> None:
        if w.request_id == self.rid:
            self.kv += [(int(w.step), str(w.model), int(w.layer), int(w.start) + i, int(k), int(v))
                        for i, (k, v) in enumerate(zip(w.k_hashes.tolist(), w.v_hashes.tolist()))]

    def on_record(self, table, **c) -> None:
        if table == "draws" and c["request"] == self.rid:
            self.draws.append(tuple(sorted((k, str(v)) for k, v in c.items())))


def _replay(replayer, trace, rid, until, forced=None, *, sparse: bool):
    bits = Bits(rid)
    got = replayer.run(trace, forced=forced, observers=[bits], focus={rid} if sparse else None, stop_after=until)
    out = got.outputs[rid]
    return got, (list(out.tokens), np.asarray(out.topk_ids).tolist(),
                 np.asarray(out.topk_logits, np.float32).view(np.uint32).tolist(), sorted(bits.kv), bits.draws)


def _crowded_step(trace, rid: str) -> int:
    """The step that computed `rid` beside the most other rows."""
    steps = [p for p in trace.iter_plans() if any(s.request_id == rid for s in p.slices)]
    return max(steps, key=lambda p: (len(p.slices), p.rows)).index


def assert_sparse_is_full(path, *, expect_sparse: bool = True, forced_too: bool = True):
    from divergence.analysis.replayer import Replayer

    sparse, full = Replayer(), Replayer(sparse=False)
    with Trace.open(path) as t:
        ids = [r.id for r in t.requests if len(t.tokens(r.id).tokens)]
        assert len(ids) >= 2
        proved = 0
        for rid in (ids[len(ids) // 2], ids[-1]):  # a request in the middle, and the last
            until = int(t.tokens(rid).steps[-1])
            runs = [None] + ([{_crowded_step(t, rid): SOLO}] if forced_too else [])
            for forced in runs:
                got_s, bits_s = _replay(sparse, t, rid, until, forced, sparse=True)
                got_f, bits_f = _replay(full, t, rid, until, forced, sparse=False)
                assert bits_s[0], (rid, "no tokens replayed")
                for name, x, y in zip(("tokens", "top-k ids", "top-k logits", "K/V hashes", "draws"), bits_s, bits_f):
                    assert x == y, (path.name, rid, forced, name)
                if expect_sparse:
                    w = got_s.window
                    assert w is not None, got_s.full_because
                    assert rid in w.real and w.steps < w.of or w.first == 0, w
                    proved += w.steps < w.of
                else:
                    assert got_s.window is None and got_s.full_because
        if expect_sparse:
            assert proved, "no replay ran fewer steps than the trace: nothing sparse was checked"
        return t


