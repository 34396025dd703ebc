"""Buffered events -> record arrays of each table (the writer encodes a few steps' events at once).

The writer appends event objects to lists as they come; everything here (codes,
request indexes, running offsets, padding of 2-D columns) happens a batch at a time,
in order. An event fills the columns its fields are named after (`request`
from `request_id`); columns it lacks get their schema default.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import groupby
from operator import attrgetter

import numpy as np

from ..core.events import KERNEL_ROW, StepKernels, StepKvWrites
from . import schema as S
from .layout import concat


@dataclass
class Batch:
    """Everything emitted since the last encoding, per table, in emission order."""

    items: dict = field(default_factory=dict)  # table -> list of event objects or Cols
    steps: int = 0  # StepEvents in this batch

    def add(self, table: str, item) -> None:
        lst = self.items.get(table)
        if lst is None:
            self.items[table] = [item]
        else:
            lst.append(item)


class _Codes(dict):
    """name -> code; codes given as ints pass through, unknown names are one clear error."""

    def __init__(self, mapping, what: str):
        super().__init__(mapping)
        self.what = what

    def __missing__(self, key):
        if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
            return int(key)
        raise ValueError(f"unknown {self.what}: {key!r}")


class Cols(dict):
    """Columns given to TraceWriter.append (arrays or scalars, broadcast to one length)."""


_K_HASHES, _V_HASHES, _DTYPE = attrgetter("k_hashes"), attrgetter("v_hashes"), attrgetter("dtype")
_WORDS = {np.dtype(np.uint64), np.dtype(np.int64)}  # hashes whose bytes are their uint64 values


class Encoder:
    def __init__(self, dtypes: dict[str, np.dtype], request_index: dict[str, int], code_tables: dict):
        self.dtypes = dtypes
        self.codes = {k: _Codes({n: i for i, n in enumerate(v)}, f"name in attrs[{k!r}]")
                      for k, v in code_tables.items()}
        self.req = _Codes(request_index, "request")
        self.n_slices = self.n_input = self.n_logit_rows = self.n_hashes = self.n_choices = 0
        self._attrs: dict = {}
        self._readers: dict = {}
        self._kernel_block: tuple[list, np.ndarray] | None = None  # the last step's kernel rows and records

    def encode(self, batch: Batch) -> dict[str, list[np.ndarray]]:
        out: dict[str, list[np.ndarray]] = {}
        for table, items in batch.items.items():
            for group in _runs(items):
                if isinstance(group, Cols):
                    self._put(out, table, self._cols(table, group))
                elif table == "steps":
                    self._steps(out, group)
                elif table == "kv_writes":
                    if type(group[0]) is StepKvWrites:
                        self._kv_steps(out, group)
                    else:
                        self._kv(out, group)
                elif table == "routing":
                    self._routing(out, group)
                elif table == "kernels" and type(group[0]) is StepKernels:
                    self._put(out, table, self._kernel_steps(group))
                else:
                    self._put(out, table, self._objects(table, group))
        return out

    @staticmethod
    def _put(out, table, arr) -> None:
        if len(arr):
            out.setdefault(table, []).append(arr)

    # -- values -> stored values ------------------------------------------------------------
    def _table_of(self, c: S.Column) -> "_Codes":
        return self.req if c.codes == S.REQUEST else self.codes[c.codes]

    def _code(self, c: S.Column, vals):
        arr = np.asarray(vals)
        if arr.dtype.kind in "iub":
            return arr
        table = self._table_of(c)
        return np.array([table[v] for v in arr.ravel().tolist()], np.int64).reshape(arr.shape)

    def _fill(self, rec: np.ndarray, name: str, c: S.Column, vals) -> None:
        if c.codes is not None:
            vals = self._code(c, vals)
        width = rec.dtype[name].shape
        if width and isinstance(vals, list) and vals:
            vals = _stacked(vals, width)  # every row full (the engine's top-k): one copy, not one per row
        if width and isinstance(vals, list):  # ragged rows (top-k of any length): pad
            w = width[0]
            col = np.full((len(rec), w), c.default, c.dtype)
            for i, v in enumerate(vals):
                v = np.asarray(v).ravel()[:w]
                col[i, : len(v)] = v
            vals = col
        elif width and np.ndim(vals) == 2 and np.shape(vals)[1] != width[0]:
            col = np.full((len(rec), width[0]), c.default, c.dtype)
            k = min(width[0], np.shape(vals)[1])
            col[:, :k] = np.asarray(vals)[:, :k]
            vals = col
        rec[name] = vals

    def _objects(self, table: str, objs: list) -> np.ndarray:
        """Records of event objects: each scalar column read from all of them at once (a
        field getter mapped over them, in C: no tuple per object, so no burst of objects
        for the cyclic GC to count), code columns mapped through their name table, 2-D
        columns padded row by row."""
        dt = self.dtypes[table]
        n = len(objs)
        scalars, defaults, wide = self._reader(table, type(objs[0]))
        rec = np.empty(n, dt)
        for name, get, codes in scalars:
            col = map(get, objs)
            if codes is not None:
                col = map(codes.__getitem__, col)
            try:
                rec[name] = np.fromiter(col, dt[name], n)
            except (TypeError, ValueError, OverflowError):  # values fromiter refuses: numpy's conversion
                col = map(get, objs)
                rec[name] = np.array(list(col if codes is None else map(codes.__getitem__, col)), dt[name])
        for name, default in defaults:
            rec[name] = default
        for name, attr in wide:
            c = S.TABLES[table].columns[name]
            if attr is None:
                rec[name] = c.default
            else:
                self._fill(rec, name, c, list(map(attrgetter(attr), objs)))
        return rec

    def _reader(self, table: str, kind: type):
        """([(scalar column, getter of its field, its code table or None)], [(column, default)]
        for columns the event lacks, [(2-D column, field or None)])."""
        key = (table, kind)
        got = self._readers.get(key)
        if got is None:
            dt = self.dtypes[table]
            scalars, defaults, wide = [], [], []
            for name, c in S.TABLES[table].columns.items():
                attr = self._attr(kind, name)
                if dt[name].shape:
                    wide.append((name, attr))
                elif attr is None:
                    defaults.append((name, c.default))
                else:
                    scalars.append((name, attrgetter(attr), None if c.codes is None else self._table_of(c)))
            got = self._readers[key] = (scalars, defaults, wide)
        return got

    def _attr(self, kind: type, column: str) -> str | None:
        key = (kind, column)
        if key not in self._attrs:
            fields = getattr(kind, "__dataclass_fields__", None) or vars(kind)
            self._attrs[key] = next((a for a in (column, column + "_id") if a in fields), None)
        return self._attrs[key]

    def _cols(self, table: str, cols: Cols) -> np.ndarray:
        spec = S.TABLES[table].columns
        n = max((len(v) for k, v in cols.items() if np.ndim(v) >= 1 and not (spec[k].width and np.ndim(v) == 1)),
                default=1)
        rec = np.empty(n, self.dtypes[table])
        for name, c in spec.items():
            if name not in cols:
                rec[name] = c.default
                continue
            v = cols[name]
            if c.codes is not None and np.ndim(v) == 0:
                v = self._code(c, [v])[0]
            self._fill(rec, name, c, v if np.ndim(v) else np.broadcast_to(np.asarray(v), (n,)))
        return rec

    def _kernel_steps(self, steps: list) -> np.ndarray:
        """The records of steps' kernel choices given as rows (StepKernels): the records
        _objects makes of their KernelChoice events. A step whose rows equal those of the
        last step made (the block) reuses its records with the step changed; one whose rows
        differ from them in a few places only (every decode step: its attention rows carry the
        growing KV length, its linear ops' rows are the same tuples) reuses them with those
        rows made anew, all such rows of a run of steps in one go; other steps are made a
        column at a time from the rows."""
        parts, pending, derived = [], [], []  # pending: new steps; derived: (step, rows changed) from the block

        def make_pending() -> None:
            if pending:
                rec = self._kernel_rows(pending)
                parts.append(rec)
                self._kernel_block = (pending[-1].rows, rec[len(rec) - len(pending[-1].rows):].copy())
                pending.clear()

        def make_derived() -> None:
            if derived:
                block = self._kernel_block[1]
                n = len(block)
                rec = np.tile(block, len(derived))
                rec["step"] = np.repeat(np.array([sk.step for sk, _ in derived], np.int64), n)
                at = [j * n + i for j, (_, changed) in enumerate(derived) for i in changed]
                if at:
                    rec[at] = self._kernel_rows([StepKernels(sk.step, [sk.rows[i] for i in changed])
                                                 for sk, changed in derived if changed])
                parts.append(rec)
                self._kernel_block = (derived[-1][0].rows, rec[len(rec) - n:].copy())
                derived.clear()

        for sk in steps:
            if not sk.rows:
                continue
            # compared with the step before when it is new, else with the block (a run of
            # derived steps all derive from the one block)
            before = pending[-1].rows if pending else self._kernel_block and self._kernel_block[0]
            changed = _changed_rows(before, sk.rows) if before else None
            if changed is None:
                make_derived()
                pending.append(sk)
            else:
                make_pending()  # (the block is now the step before's)
                derived.append((sk, changed))
        make_pending()
        make_derived()
        if not parts:
            return np.empty(0, self.dtypes["kernels"])
        return parts[0] if len(parts) == 1 else concat(parts)

    def _kernel_rows(self, steps: list) -> np.ndarray:
        """The records of steps' rows, a column at a time."""
        rows = [r for sk in steps for r in sk.rows]
        n = len(rows)
        dt = self.dtypes["kernels"]
        rec = np.empty(n, dt)
        cols = dict(zip(KERNEL_ROW, zip(*rows)))
        for name, c in S.TABLES["kernels"].columns.items():
            if name == "step":
                rec[name] = np.repeat(np.array([sk.step for sk in steps], np.int64), [len(sk.rows) for sk in steps])
                continue
            vals = cols.get(name)
            if vals is None:
                rec[name] = c.default
                continue
            codes = None if c.codes is None else self._table_of(c).__getitem__
            try:
                rec[name] = np.fromiter(vals if codes is None else map(codes, vals), dt[name], n)
            except (TypeError, ValueError, OverflowError):  # values fromiter refuses: numpy's conversion
                rec[name] = np.array(list(vals if codes is None else map(codes, vals)), dt[name])
        return rec

    # -- the tables with running offsets ------------------------------------------------------
    def _steps(self, out, events: list) -> None:
        st = np.empty(len(events), self.dtypes["steps"])
        slices, input_tokens, logit_rows = [], [], []
        models, phases = self.codes["models"], self.codes["phases"]
        for i, e in enumerate(events):
            plan = e.plan
            st[i] = (plan.index, models[plan.model], e.duration_s, plan.rows, self.n_slices, len(plan.slices))
            for s in plan.slices:
                slices.append((plan.index, self.req[s.request_id], phases[s.phase], s.start, s.count, s.row_offset,
                               self.n_input, self.n_logit_rows, len(s.logit_rows)))
                input_tokens.extend(s.tokens)
                logit_rows.extend(s.logit_rows)
                self.n_input += len(s.tokens)
                self.n_logit_rows += len(s.logit_rows)
            self.n_slices += len(plan.slices)
        self._put(out, "slices", _records(slices, self.dtypes["slices"]))
        self._put(out, "slice_tokens", _values(input_tokens, self.dtypes["slice_tokens"]))
        self._put(out, "slice_logit_rows", _values(logit_rows, self.dtypes["slice_logit_rows"]))
        self._put(out, "steps", st)

    def _kv(self, out, writes: list) -> None:
        rec = self._objects("kv_writes", writes)
        counts = rec["count"].astype(np.int64)
        rec["hash_offset"] = self.n_hashes + np.cumsum(counts) - counts
        self.n_hashes += int(counts.sum())
        h = np.empty(int(counts.sum()), self.dtypes["kv_hashes"])
        if len(h):
            h["k_hash"] = _hashes(list(map(_K_HASHES, writes)), len(h))
            h["v_hash"] = _hashes(list(map(_V_HASHES, writes)), len(h))
        self._put(out, "kv_writes", rec)
        self._put(out, "kv_hashes", h)

    def _kv_steps(self, out, steps: list) -> None:
        """The records of steps' writes given as columns (StepKvWrites): the records _kv makes
        of their KvWrite events, made per slice, not per write."""
        models, req = self.codes["models"], self.req
        per_slice = [(sw.step, models[sw.model], req[s.request_id], s.start, s.count, sw.layers)
                     for sw in steps for s in sw.slices]
        if not per_slice:
            return
        step, model, request, start, count, layers = (np.array(c, np.int64) for c in zip(*per_slice))
        n = int(layers.sum())  # writes: one per slice and layer
        first = np.cumsum(layers) - layers  # each slice's first write
        cols = {"step": step, "model": model, "request": request, "start": start, "count": count}
        rec = np.empty(n, self.dtypes["kv_writes"])
        for name, c in S.TABLES["kv_writes"].columns.items():
            if name in cols:
                rec[name] = np.repeat(cols[name], layers)
            elif name == "layer":
                rec[name] = np.arange(n) - np.repeat(first, layers)
            elif name != "hash_offset":
                rec[name] = c.default
        counts = np.repeat(count, layers)
        rec["hash_offset"] = self.n_hashes + np.cumsum(counts) - counts
        total = int(counts.sum())
        self.n_hashes += total
        h = np.empty(total, self.dtypes["kv_hashes"])
        if total:
            h["k_hash"] = np.concatenate([sw.k for sw in steps]) if len(steps) > 1 else steps[0].k
            h["v_hash"] = np.concatenate([sw.v for sw in steps]) if len(steps) > 1 else steps[0].v
        self._put(out, "kv_writes", rec)
        self._put(out, "kv_hashes", h)


    def _routing(self, out, events: list) -> None:
        """One routing record per row of each event (experts [count, k]); choices in order."""
        counts = np.array([r.count for r in events], np.int64)
        ks = np.array([np.shape(r.experts)[1] if r.count else 0 for r in events], np.int64)
        rec = np.empty(int(counts.sum()), self.dtypes["routing"])
        if len(rec):
            rep = lambda vals: np.repeat(np.asarray(vals), counts)  # noqa: E731
            models, req = self.codes["models"], self.req
            rec["step"] = rep([r.step for r in events])
            rec["model"] = rep([models[r.model] for r in events])
            rec["request"] = rep([req[r.request_id] for r in events])
            rec["layer"] = rep([r.layer for r in events])
            rec["position"] = np.concatenate([np.arange(r.start, r.start + r.count) for r in events])
            k = rep(ks)
            rec["k"] = k
            rec["choice_offset"] = self.n_choices + np.cumsum(k) - k
            for col in ("runner_up", "runner_up_score", "input_hash"):
                rec[col] = np.concatenate([np.asarray(getattr(r, col)).reshape(-1) for r in events])
        ch = np.empty(int((counts * ks).sum()), self.dtypes["routing_choices"])
        if len(ch):
            ch["expert"] = np.concatenate([np.asarray(r.experts).reshape(-1) for r in events])
            ch["score"] = np.concatenate([np.asarray(r.scores).reshape(-1) for r in events])
        self.n_choices += len(ch)
        self._put(out, "routing", rec)
        self._put(out, "routing_choices", ch)


def _records(rows: list[tuple], dt: np.dtype) -> np.ndarray:
    """np.array(rows, dt) for rows of scalars, a column at a time (numpy packs a tuple into a
    compound record field by field through generic code, where np.fromiter fills a column in
    C); anything fromiter refuses goes the generic way, as before."""
    n = len(rows)
    if n < 16:
        return np.array(rows, dt)
    rec = np.empty(n, dt)
    try:
        for name, col in zip(dt.names, zip(*rows)):
            rec[name] = np.fromiter(col, dt[name], n)
    except (TypeError, ValueError, OverflowError):
        return np.array(rows, dt)
    return rec


def _hashes(arrs: list, n: int) -> np.ndarray:
    """The writes' hashes, concatenated: their bytes joined when they are n 64-bit integers in
    all (the engine's uint64 views; half the time of np.concatenate on 1-element arrays)."""
    try:
        if set(map(_DTYPE, arrs)) <= _WORDS:
            raw = b"".join(arrs)
            if len(raw) == 8 * n:
                return np.frombuffer(raw, np.uint64)
    except (AttributeError, TypeError, BufferError, ValueError):  # lists, non-contiguous views
        pass
    return np.concatenate(arrs, axis=None)


def _stacked(vals: list, width: tuple):
    """vals as one [n, w] array when every row has the shape `width` (else vals as given), in
    one concatenation: np.stack expands every row in Python first, which costs more than the
    copy itself for a run's many small top-k rows."""
    if set(map(np.shape, vals)) != {width}:  # ragged rows, or not arrays
        return vals
    try:
        return np.concatenate(vals).reshape((len(vals),) + width)
    except (ValueError, TypeError):
        return vals


def _values(values: list, dtype: np.dtype) -> np.ndarray:
    rec = np.empty(len(values), dtype)
    rec["value"] = values
    return rec


def _runs(items: list):
    """Consecutive event objects of one type grouped into lists; each Cols on its own."""
    for kind, group in groupby(items, key=type):
        if kind is Cols:
            yield from group
        else:
            yield list(group)


def _changed_rows(before: list, rows: list) -> list[int] | None:
    """Where `rows` differ from an earlier step's `before` (rows of one length), when that is
    at most half of them (the rest keep their records; [] when none differ); None otherwise.
    The dispatcher hands an unchanged op the same tuple, so most rows are equal by identity."""
    if len(before) != len(rows):
        return None
    if before == rows:
        return []
    changed = [i for i, (a, b) in enumerate(zip(before, rows)) if a is not b and a != b]
    return changed if 2 * len(changed) <= len(rows) else None
