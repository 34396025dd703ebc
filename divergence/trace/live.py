"""Which record of a request is live at a step: the latest write of each (layer,
position) with step <= the step (a later write overwrites a rolled-back position; within
one step, record order decides). Pure numpy over a trace's table columns; `Trace.live_kv`
and `Trace.routing` select the request's rows and call these."""
from __future__ import annotations

import numpy as np


def kv_cells(w: dict, h: dict, idx: np.ndarray) -> dict[str, np.ndarray]:
    """w: the kv_writes table, h: the kv_hashes table, idx: the rows of one request (and
    model, up to a step). Arrays layer, position, step, k_hash, v_hash, one per live
    (layer, position), sorted by (layer, position)."""
    count = w["count"][idx].astype(np.int64)
    total = int(count.sum())
    empty = {k: np.zeros(0, dt) for k, dt in (("layer", np.int16), ("position", np.int32), ("step", np.int64),
                                                ("k_hash", np.uint64), ("v_hash", np.uint64))}
    if total == 0:
        return empty
    rep = np.repeat(np.arange(idx.size), count)
    within = np.arange(total) - np.repeat(np.cumsum(count) - count, count)
    layer = w["layer"][idx][rep]
    position = w["start"][idx][rep] + within
    step = w["step"][idx][rep]
    order = np.arange(total)  # record order breaks ties between writes of one step
    hrow = w["hash_offset"][idx][rep] + within
    key = layer.astype(np.int64) * (int(position.max()) + 1) + position
    srt = np.lexsort((order, step, key))
    key_s = key[srt]
    last = np.flatnonzero(np.r_[key_s[1:] != key_s[:-1], True])
    pick = srt[last]
    hrow_p = hrow[pick]
    return {"layer": layer[pick], "position": position[pick], "step": step[pick],
            "k_hash": h["k_hash"][hrow_p], "v_hash": h["v_hash"][hrow_p]}


def routing_cells(t: dict, ch: dict, idx: np.ndarray) -> dict[str, np.ndarray]:
    """t: the routing table, ch: routing_choices, idx: the rows of one request. One row per
    live (layer, position), sorted by (position, layer): layer, position, step, runner_up,
    runner_up_score, input_hash [n], experts int32 [n, k], scores float32 [n, k]."""
    key = t["position"][idx].astype(np.int64) * 65536 + t["layer"][idx]
    srt = np.lexsort((idx, t["step"][idx], key))  # latest write of a (position, layer) last
    ks = key[srt]
    pick = idx[srt[np.flatnonzero(np.r_[ks[1:] != ks[:-1], True])]] if idx.size else idx
    out = {c: t[c][pick] for c in ("layer", "position", "step", "runner_up", "runner_up_score", "input_hash")}
    k = int(t["k"][pick].max()) if pick.size else 0
    if pick.size and not (t["k"][pick] == k).all():
        raise ValueError("routing rows of one request hold different k")  # one model: one top-k
    rows = t["choice_offset"][pick][:, None] + np.arange(k)[None, :]
    out["experts"] = ch["expert"][rows].astype(np.int32)
    out["scores"] = ch["score"][rows]
    return out
