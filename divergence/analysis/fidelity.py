"""How faithful a replay is to its trace: tokens, logits, K/V writes and the sampler's draws,
bit for bit (ReplayReport). Engine-free."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .diff import DiffReport, diff_traces
from .force_spec import describe_forced
from .sampler import has_draws


@dataclass
class ReplayReport:
    source: str
    out: str | None
    forced: dict[int, str]
    faithful: bool
    tokens_equal: bool
    logits_equal: bool
    kv_equal: bool | None  # None when either trace has no KV hashes
    first_difference: dict | None  # {request, position} of the first token/logit difference
    kv_first_difference: dict | None
    seconds: float
    original_seconds: float
    diff: DiffReport | None = field(default=None, repr=False)
    draws_equal: bool | None = None  # the sampler's draws and their outcomes; None when either has none

    def to_json(self) -> dict:
        return {"source": self.source, "out": self.out, "forced": {str(k): v for k, v in self.forced.items()},
                "faithful": self.faithful, "tokens_equal": self.tokens_equal, "logits_equal": self.logits_equal,
                "kv_equal": self.kv_equal, "first_difference": self.first_difference,
                "kv_first_difference": self.kv_first_difference, "seconds": self.seconds,
                "original_seconds": self.original_seconds, "draws_equal": self.draws_equal}


def fidelity(original, replayed, forced: dict, seconds: float, out: str | None) -> ReplayReport:
    d = diff_traces(original, replayed, bitwise=True)
    first = None
    tokens_equal = logits_equal = True
    for r in d.requests:
        if r.first_divergent_token is not None or r.len_a != r.len_b:
            tokens_equal = False
        if r.first_numeric_divergence is not None:
            logits_equal = False
            if first is None:
                first = {"request": r.id, "position": r.first_numeric_divergence.position}
    kv_equal, kv_first = None, None
    if original.has_kv_hashes and replayed.has_kv_hashes:
        kv_equal, kv_first = _compare_kv(original, replayed)
    draws_equal = _compare_draws(original, replayed)
    faithful = tokens_equal and logits_equal and kv_equal is not False and draws_equal is not False
    total = float(np.sum(original.steps["duration"])) if original.num_steps else 0.0
    return ReplayReport(str(original.path), out, describe_forced(forced), faithful, tokens_equal,
                        logits_equal, kv_equal, first, kv_first, seconds, total, d, draws_equal)


def _compare_draws(a, b) -> bool | None:
    """The same draws (step, request, position, purpose, u, token, outcome range), in any order."""
    if not (has_draws(a) and has_draws(b)):
        return None

    def rows(t):
        d = t.table("draws")
        ints = zip(*(np.asarray(d[c]).tolist() for c in ("step", "request", "position", "token")))
        bits = zip(*(np.asarray(d[c], np.float64).view(np.uint64).tolist() for c in ("value", "lo", "hi")))
        return sorted((i, str(p), f) for i, p, f in zip(ints, d["purpose"], bits))

    return rows(a) == rows(b)


def _compare_kv(a, b):
    """Every recorded K/V write, position by position, equal in both traces? Compared as
    sorted cells (step, model, request, layer, position, k, v): the order in which one
    step's writes were emitted, and how runs of positions were grouped, carry no meaning."""
    ca, cb = _kv_cells(a), _kv_cells(b)
    if len(ca) != len(cb):
        return False, {"reason": f"{len(ca)} vs {len(cb)} K/V positions written"}
    bad = np.flatnonzero((ca != cb).any(axis=1))
    if bad.size:
        step, model, req, layer, pos = (int(x) for x in cb[bad[0], :5])
        rid = b.requests[req].id if 0 <= req < len(b.requests) else str(req)
        return False, {"step": step, "request": rid, "layer": layer, "position": pos,
                       "reason": f"the K/V write of {rid} at step {step}, layer {layer}, position {pos} differs"}
    return True, None


def _kv_cells(trace) -> np.ndarray:
    w, h = trace.kv_writes(), trace.kv_hashes()
    count = np.asarray(w["count"], np.int64)
    if not count.size:
        return np.zeros((0, 7), np.uint64)
    rep = np.repeat(np.arange(count.size), count)
    within = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    hrow = np.asarray(w["hash_offset"], np.int64)[rep] + within
    cols = [np.asarray(w["step"])[rep], np.asarray(w["model"])[rep], np.asarray(w["request"])[rep],
            np.asarray(w["layer"])[rep], np.asarray(w["start"])[rep] + within,
            np.asarray(h["k_hash"])[hrow], np.asarray(h["v_hash"])[hrow]]
    cells = np.stack([np.asarray(c).astype(np.int64).view(np.uint64) for c in cols], axis=1)
    return cells[np.lexsort(cells[:, ::-1].T)]
