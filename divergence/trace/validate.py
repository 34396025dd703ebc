"""Schema checks of a trace's tables, run once per table per snapshot, when it is first read.

A trace edited (or damaged) after it was written can pass the checks at open and still
hold records the readers cannot use: a column of the wrong dtype, an offset past the end
of the table it points into, a code no code table names, a request index past /requests,
rows its commit record names but the file lacks. Each is one TraceError naming the table
and the first bad row ("PATH is a damaged trace: /kv_writes row 5: hash_offset ... "), so
every reader (diff, bisect, replay, report, browse, the pytest plugin) says so on one line
instead of crashing, or worse, comparing garbage. Vectorised numpy: a pass over each
column once.
"""
from __future__ import annotations

import numpy as np

from ..errors import TraceError
from . import schema as S

# column -> (count column or 1, table it points into): rows [offset, offset + count) must exist there
OFFSETS: dict[str, dict[str, tuple[str | None, str]]] = {
    "steps": {"slice_offset": ("slice_count", "slices")},
    "slices": {"token_offset": ("count", "slice_tokens"), "logit_offset": ("logit_count", "slice_logit_rows")},
    "kv_writes": {"hash_offset": ("count", "kv_hashes")},
    "routing": {"choice_offset": ("k", "routing_choices")},
    "live_requests": {"prompt_offset": ("prompt_count", "live_prompt_tokens")},
}
_KINDS = {"i": "iu", "u": "iu", "f": "f", "b": "b"}  # schema dtype kind -> stored kinds a reader can use
# column -> (least, greatest or None) value a record may hold: steps, positions, counts, token ids, layers
# (-1 where the schema pads or means "none")
RANGES: dict[str, dict[str, tuple[int, int | None]]] = {
    "steps": {"index": (0, None), "rows": (0, None), "slice_count": (0, None)},
    "slices": {"step": (0, None), "start": (0, None), "count": (0, None), "row_offset": (0, None),
               "logit_count": (0, None)},
    "slice_tokens": {"value": (0, None)},
    "slice_logit_rows": {"value": (0, None)},
    "kernels": {"step": (0, None), "layer": (0, None), "m": (0, None), "n": (0, None), "k": (0, None),
                "splits": (0, None), "expert": (-1, None), "kv_min": (0, None)},
    "kv_writes": {"step": (0, None), "layer": (0, None), "start": (0, None), "count": (0, None)},
    "tokens": {"step": (0, None), "position": (0, None), "token": (0, None), "spec": (0, 2), "topk_ids": (-1, None)},
    "request_events": {"step": (0, None)},
    "draws": {"step": (0, None), "position": (0, None), "token": (-1, None), "prev_token": (-1, None),
              "next_token": (-1, None)},
    "routing": {"step": (0, None), "layer": (0, None), "position": (0, None), "k": (0, None), "runner_up": (-1, None)},
    "routing_choices": {"expert": (0, None)},
    "allreduce": {"step": (0, None), "layer": (0, None), "ranks": (1, None), "bytes": (0, None)},
    "live_requests": {"prompt_count": (0, None), "arrival": (0, None), "max_tokens": (0, None)},
    "live_prompt_tokens": {"value": (0, None)},
}
# tables whose `step` names a step of /steps (readers look it up there); kv_writes may name a step of an
# earlier trace segment (a prefix-cache hit), request_events a step not yet run
STEP_TABLES = ("slices", "kernels", "tokens", "draws", "routing", "allreduce")


def one_line(text) -> str:
    """A message on one line (HDF5's span several)."""
    return " ".join(str(text).split())


def damaged(path, what: str) -> TraceError:
    return TraceError(f"{path} is a damaged trace: {one_line(what)}")


def records(path, name: str, rec) -> None:
    """A schema-2 table as stored: a compound dataset (its fields named like columns)."""
    if getattr(rec, "dtype", None) is None or rec.dtype.names is None:
        dt = getattr(rec, "dtype", type(rec).__name__)
        raise damaged(path, f"/{name} is not a table of records (it holds {dt})")


def rows_committed(path, name: str, got: int, want: int) -> None:
    if got < want:
        raise damaged(path, f"/{name} holds {got} rows, its commit record names {want}")


def _first(bad: np.ndarray) -> int:
    return int(np.flatnonzero(bad)[0])


def table(trace, name: str, cols: dict[str, np.ndarray], widths: dict) -> None:
    """Dtypes, shapes and lengths of the columns the file stored (`cols`, before defaults)."""
    t = S.TABLES[name]
    n = None
    for col, a in cols.items():
        c = t.columns.get(col)
        if c is None:
            continue
        want = np.dtype(c.dtype)
        if a.dtype.kind not in _KINDS.get(want.kind, want.kind):
            raise damaged(trace.path, f"/{name} column {col} is {a.dtype}, not {want}")
        ndim = 1 if c.width is None else 2
        if a.ndim != ndim:
            raise damaged(trace.path, f"/{name} column {col} has {a.ndim} dimensions, not {ndim}")
        if ndim == 2 and a.shape[1] != S.column_width(c, widths):
            raise damaged(trace.path, f"/{name} column {col} is {a.shape[1]} wide, where the file's attributes say "
                                      f"{c.width} {S.column_width(c, widths)}")
        if n is None:
            n = len(a)
        elif len(a) != n:
            raise damaged(trace.path, f"/{name} column {col} holds {len(a)} rows, not {n}")


def contents(trace, name: str, t: dict[str, np.ndarray], *, partial: bool = False) -> None:
    """Codes known, request indices within /requests, offsets within the tables they point into."""
    spec = S.TABLES[name]
    n = len(next(iter(t.values()))) if t else 0
    if n == 0:
        return
    for col, c in spec.columns.items():
        if c.codes is None:
            continue
        v = t[col]
        if c.codes == S.REQUEST:
            limit, what = len(trace.requests), "requests"
        else:
            limit, what = len(trace.codes(c.codes)), f"attrs['{c.codes}']"
        bad = (v < 0) | (v >= limit)
        if bad.any():
            i = _first(bad)
            raise damaged(trace.path, f"/{name} row {i}: {col} {int(v[i])} is not an index into {what} "
                                      f"({limit} entries)")
    _ranges(trace, name, t)
    for col, (count, target) in OFFSETS.get(name, {}).items():
        if target == "kv_hashes" and not trace.has_kv_hashes:
            continue  # a run without KV hashes: its writes point nowhere
        off = t[col].astype(np.int64)
        cnt = t[count].astype(np.int64) if count else np.ones(n, np.int64)
        limit = trace._rows(target)
        bad = (off < 0) | (cnt < 0) | (off + cnt > limit)
        if bad.any():
            i = _first(bad)
            raise damaged(trace.path, f"/{name} row {i}: {col} {int(off[i])} + {count} {int(cnt[i])} is past the "
                                      f"end of /{target} ({limit} rows)")
    if name == "steps":
        _steps(trace, t)
    elif name in STEP_TABLES:
        _known_steps(trace, name, t, partial)
    if name == "tokens":
        _tokens(trace, t, partial)


def _ranges(trace, name: str, t: dict[str, np.ndarray]) -> None:
    for col, (lo, hi) in RANGES.get(name, {}).items():
        v = t[col]
        bad = (v < lo) if hi is None else (v < lo) | (v > hi)
        if bad.any():
            i = int(np.flatnonzero(bad.reshape(len(v), -1).any(axis=1))[0])
            x = v[i] if v.ndim == 1 else v[i][bad[i]][0]
            want = f">= {lo}" if hi is None else f"in {lo}..{hi}"
            raise damaged(trace.path, f"/{name} row {i}: {col} {int(x)} is not {want}")


def _steps(trace, t: dict[str, np.ndarray]) -> None:
    """Steps in the order they ran, each once (readers find a step by its index)."""
    idx = t["index"]
    back = np.diff(idx.astype(np.int64)) <= 0
    if back.any():
        i = _first(back) + 1
        raise damaged(trace.path, f"/steps row {i}: index {int(idx[i])} does not follow {int(idx[i - 1])} (steps are "
                                  f"recorded in order, each once)")


def _known_steps(trace, name: str, t: dict[str, np.ndarray], partial: bool = False) -> None:
    """Each record's step is one /steps holds (or one after this snapshot's last); a step's slices
    (its slice_offset, slice_count rows of /slices) name that step."""
    st = trace.steps
    idx = st["index"]
    step = t["step"]
    if len(idx):
        at = np.minimum(np.searchsorted(idx, step), len(idx) - 1)
        bad = (step <= idx[-1]) & (idx[at] != step)
    else:
        bad = np.zeros(len(step), bool)
    if bad.any():
        i = _first(bad)
        raise damaged(trace.path, f"/{name} row {i}: step {int(step[i])} is not a step of /steps")
    if name != "slices" or not len(idx) or partial:
        return
    count = st["slice_count"].astype(np.int64)
    rows = np.repeat(st["slice_offset"].astype(np.int64) - np.cumsum(count) + count, count) + np.arange(count.sum())
    wrong = step[rows] != np.repeat(idx, count)
    if wrong.any():
        j = _first(wrong)
        raise damaged(trace.path, f"/slices row {int(rows[j])}: step {int(step[rows[j]])}, but /steps names it a "
                                  f"slice of step {int(np.repeat(idx, count)[j])}")


def _tokens(trace, t: dict[str, np.ndarray], partial: bool = False) -> None:
    ids, logits = t["topk_ids"], t["topk_logits"]
    if ids.shape != logits.shape:
        raise damaged(trace.path, f"/tokens topk_ids is {ids.shape[1:]} wide but topk_logits {logits.shape[1:]}")
    bad = np.isnan(logits) & (ids >= 0)
    if bad.any():
        i = int(np.flatnonzero(bad.any(axis=1))[0])
        raise damaged(trace.path, f"/tokens row {i}: a recorded top-k id ({int(ids[i][bad[i]][0])}) has a NaN "
                                  f"logit (damaged, or the model produced NaN)")
    if partial or not trace.completed:  # (partial: some requests' rows, trace/ranged.py)
        return
    # a completed run: every finished request has its tokens, none after its finish
    ev = trace.table("request_events", raw=True)
    fin = ev["kind"] == trace.codes("kinds").index("finished")
    if not fin.any():
        return
    req, at = ev["request"][fin].astype(np.int64), ev["step"][fin]
    nreq = len(trace.requests)
    last = np.full(nreq, -1, np.int64)
    np.maximum.at(last, t["request"].astype(np.int64), t["step"].astype(np.int64))
    none = last[req] < 0
    if none.any():
        rid = trace.requests[int(req[_first(none)])].id
        raise damaged(trace.path, f"/tokens holds no token of {rid}, which finished at step {int(at[_first(none)])} "
                                  f"of this completed run (the table was cut?)")
    finish = np.full(nreq, np.iinfo(np.int64).max, np.int64)
    np.minimum.at(finish, req, at.astype(np.int64))
    late = t["step"].astype(np.int64) > finish[t["request"].astype(np.int64)]
    if late.any():
        i = _first(late)
        rid = trace.requests[int(t["request"][i])].id
        raise damaged(trace.path, f"/tokens row {i}: a token of {rid} at step {int(t['step'][i])}, after it "
                                  f"finished (step {int(finish[t['request'][i]])})")
