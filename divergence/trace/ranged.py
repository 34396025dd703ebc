"""Reading parts of tables: what a request or a step recorded, without the whole table.

A live server's trace grows without end (a day of traffic: gigabytes), and diff and bisect
need a few requests' rows and a few steps' records of it. A Trace reads ranges when it is
`ranged`: a large file (LARGE_BYTES and up), or requests chosen (`Trace.select`). Then:

- a step's records (kernels, all-reduces, slices) are the rows between two binary searches
  over the `step` column: this engine appends every by-step table in step order;
- a request's records (tokens, K/V writes, routing) are the rows of the steps it lived
  (from its request events), filtered by request; its K/V hashes and routing choices the
  rows its records point at. One exception to step order: a prefix-cache hit's inherited
  K/V writes name the older steps that wrote them, and are appended when the request is
  admitted; with a prefix cache, a request's K/V writes come from a scan of the `request`
  column up to the first step after the one asked for (a block at a time: bounded memory);
- the rows read are checked as whole tables are (trace/validate.py), as far as a part of a
  table can be (a completed run's per-request token counts need the whole table).

Small files keep whole-table reads (each table read once per snapshot, every table checked
when the tokens are first read). Another engine's traces (settings.engine: the Recorder,
mlx-lm's adapter) are read whole: only this engine's write order is known.
"""
from __future__ import annotations

import os

import numpy as np

from ..core.names import WARM
from . import schema as S
from . import validate
from .h5lock import H5_LOCK
from .layout import read_commit, read_range

LARGE_BYTES = 256 << 20  # files this large read ranges, not whole tables
SCAN_ROWS = 1 << 20  # rows of one column read at a time by a scan
GAP_ROWS = 4096  # pointed-at rows this close together are read as one range


def runs(starts: np.ndarray, counts: np.ndarray, gap: int | None = None) -> list[tuple[int, int]]:
    """Row ranges [lo, hi) covering [start, start + count) of each pointer, neighbours within
    `gap` rows (default GAP_ROWS) merged."""
    gap = GAP_ROWS if gap is None else gap
    keep = counts > 0
    s = starts[keep].astype(np.int64)
    if not s.size:
        return []
    order = np.argsort(s, kind="stable")
    s, e = s[order], (s + counts[keep].astype(np.int64))[order]
    out = []
    lo, hi = int(s[0]), int(e[0])
    for a, b in zip(s[1:].tolist(), e[1:].tolist()):
        if a <= hi + gap:
            hi = max(hi, b)
        else:
            out.append((lo, hi))
            lo, hi = a, b
    out.append((lo, hi))
    return out


class RangedReads:
    """Range reads for Trace (mixed in through RecordViews); see the module docstring."""

    @property
    def ranged(self) -> bool:
        """Whether per-request and per-step views read ranges (else whole tables)."""
        if not self._once("rangeable", self._rangeable):
            return False
        return self.selected is not None or self._once("large", lambda: os.path.getsize(self.path) >= LARGE_BYTES)

    def _rangeable(self) -> bool:
        return (self.version == 2 and S.COMMIT in self.f
                and not (self.meta.get("settings") or {}).get("engine"))

    @property
    def _inherits_kv(self) -> bool:
        """K/V writes may name older steps (prefix-cache hits; warm's warm-up copies)."""
        settings = self.meta.get("settings") or {}
        return bool(settings.get("prefix_caching")) or self.meta.get("schedule") == WARM

    # -- rows ----------------------------------------------------------------------------
    def _range(self, name: str, lo: int, hi: int) -> dict[str, np.ndarray]:
        """Records [lo, hi) of a table in this snapshot, checked, its schema columns complete."""
        hi = min(hi, self._rows(name))
        lo = max(0, min(lo, hi))
        with H5_LOCK:
            try:
                rec = read_range(self.f, name, lo, hi, refresh=self.swmr, commit=self._frozen) if name in self.f \
                    else None
            except Exception as e:  # noqa: BLE001  (HDF5: OSError, KeyError, TypeError of a foreign object)
                raise validate.damaged(self.path, f"cannot read /{name} rows {lo}-{hi} ({e})") from None
        if rec is None:
            return self._columns(name, {}, partial=True)
        validate.records(self.path, name, rec)
        return self._columns(name, {k: np.ascontiguousarray(rec[k]) for k in rec.dtype.names}, partial=True)

    def _ranges(self, name: str, spans: list[tuple[int, int]]) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Records of several row ranges, concatenated; and each one's row in the table."""
        parts = [self._range(name, lo, hi) for lo, hi in spans]
        rows = np.concatenate([np.arange(lo, hi, dtype=np.int64) for lo, hi in spans]) if spans else \
            np.zeros(0, np.int64)
        if not parts:
            return self._columns(name, {}, partial=True), rows
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}, rows

    def _column(self, name: str, col: str, lo: int, hi: int) -> np.ndarray:
        """One column of records [lo, hi), as stored (a search's or a scan's: not checked)."""
        with H5_LOCK:
            rec = read_range(self.f, name, lo, hi, refresh=self.swmr, commit=self._frozen)
        return np.asarray(rec[col])

    @property
    def _frozen(self) -> dict | None:
        """The commit record of a file no writer has open (read once), else None (read it each time)."""
        return None if self.swmr else self._once("frozen_commit", lambda: read_commit(self.f, refresh=False)[1])

    def _first_row(self, name: str, above, lo: int = 0, hi: int | None = None) -> int:
        """The first row in [lo, hi) whose step satisfies `above` (a predicate false then true
        along a table in step order): a binary search, a chunk read per probe."""
        hi = self._rows(name) if hi is None else hi
        while lo < hi:
            mid = (lo + hi) // 2
            if above(int(self._column(name, "step", mid, mid + 1)[0])):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _step_rows(self, name: str, first: int, last: int) -> dict[str, np.ndarray]:
        """The records of steps first..last of a table in step order (steps past the snapshot's last dropped)."""
        last = min(last, self._last_step)
        lo = self._first_row(name, lambda s: s >= first)
        hi = self._first_row(name, lambda s: s > last, lo)
        return self._range(name, lo, hi)

    # -- a request's rows ---------------------------------------------------------------------
    def _events_by_request(self) -> tuple[np.ndarray, np.ndarray, dict]:
        """request_events grouped by request: (order, starts) of a stable sort by request."""
        def load():
            ev = self._visible("request_events")
            req = ev["request"].astype(np.int64)
            order = np.argsort(req, kind="stable")
            starts = np.searchsorted(req[order], np.arange(len(self.requests) + 1))
            return order, starts, ev
        return self._once("events_by_request", load)

    def lifetime(self, request_id: str) -> tuple[int, int]:
        """The steps a request lived: (its arrival's, its last finish's; without the events: the
        snapshot's first and last). Its records all lie there, inherited K/V writes aside."""
        order, starts, ev = self._events_by_request()
        i = self.request_index(request_id)
        mine = order[starts[i]:starts[i + 1]]
        kinds = self.codes("kinds")
        steps, kind = ev["step"][mine].astype(np.int64), ev["kind"][mine]
        arrived = steps[kind == kinds.index("arrived")] if "arrived" in kinds else steps[:0]
        end = steps[np.isin(kind, [kinds.index(k) for k in ("finished", "cancelled", "error") if k in kinds])]
        return (int(arrived.min()) if arrived.size else 0), (int(end.max()) if end.size else self._last_step)

    def _request_rows(self, name: str, request_id: str, until: int | None = None) -> dict[str, np.ndarray]:
        """A request's records of a table in step order, with step <= until."""
        first, last = self.lifetime(request_id)
        t = self._step_rows(name, first, last if until is None else min(last, until))
        keep = t["request"] == self.request_index(request_id)
        return {k: v[keep] for k, v in t.items()}

    def _kv_rows_scanned(self, request_id: str, until: int | None) -> dict[str, np.ndarray]:
        """A request's K/V write records where inherited ones may name older steps: the rows up
        to the first step after `until`, their `request` column scanned a block at a time."""
        last = self._last_step if until is None else min(until, self._last_step)
        hi = self._first_row("kv_writes", lambda s: s > last)
        i = self.request_index(request_id)
        hits = []
        for lo in range(0, hi, SCAN_ROWS):
            req = self._column("kv_writes", "request", lo, min(hi, lo + SCAN_ROWS))
            hits.append(lo + np.flatnonzero(req == i))
        rows = np.concatenate(hits) if hits else np.zeros(0, np.int64)
        t, at = self._ranges("kv_writes", runs(rows, np.ones_like(rows)))
        keep = np.isin(at, rows)
        return {k: v[keep] for k, v in t.items()}

    def _ranged_kv_writes(self, request_id: str, model: str, at_step: int | None) -> dict[str, np.ndarray]:
        if self._inherits_kv:
            w = self._kv_rows_scanned(request_id, at_step)
        else:
            w = self._request_rows("kv_writes", request_id, at_step)
        sel = w["model"] == self.codes("models").index(model)
        if at_step is not None:
            sel &= w["step"] <= at_step
        return {k: v[sel] for k, v in w.items()}

    def _pointed(self, name: str, offsets: np.ndarray, counts: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The rows [offset, offset + count) of each record, read as merged ranges: (their
        records, each record's first row among them)."""
        spans = runs(offsets, counts)
        t, rows = self._ranges(name, spans)
        return t, np.searchsorted(rows, offsets.astype(np.int64))
