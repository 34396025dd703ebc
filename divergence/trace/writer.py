"""Streams engine events into an HDF5 trace (h5py, SWMR).

Every dataset is created at run start (chunked, resizable), then the file
switches to SWMR mode. Events are buffered per step; `on_step` closes the step
and hands it to the pending batch, which is written at least every
`flush_seconds` (by `on_step`, or by a small timer thread while the engine is
inside a long step). A batch is committed in two flushes: the records, then
their counts in /status, so a reader (live, or after a SIGKILL) sees whole
steps only.

While streaming, chunks are stored uncompressed: SWMR rewrites a growing
compressed chunk at a new place on every flush and never reuses the old space
(measured: 92 MB for 1 MB of data). A completed run is rewritten once,
compressed, into a temporary file that then replaces the streamed one.
"""
from __future__ import annotations

import json
import os
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import h5py
import numpy as np

from ..engine.events import KernelChoice, KvWrite, Observer, RequestEvent, RunInfo, StepEvent, TokenEvent
from ..errors import DivergenceInputError
from . import schema as S

FLUSH_SECONDS = 0.25  # a closed step reaches the file within about twice this


def _json(obj) -> str:
    return json.dumps(obj, default=str, sort_keys=True)


def _codes(names: tuple) -> dict[str, int]:
    return {n: i for i, n in enumerate(names)}


class _Buffer:
    """Records of one table waiting to be written, in order: closed `segments`
    (structured arrays), then an open part: scalar fields as row tuples (cheap per
    event) and array fields as chunks."""

    def __init__(self, table: S.Table, dtype: np.dtype, row_fields: tuple[str, ...]):
        self.table = table
        self.dtype = dtype
        self.row_fields = row_fields
        self.row_dtype = np.dtype([(n, dtype.fields[n][0]) for n in row_fields])
        self.chunk_fields = tuple(n for n in dtype.names if n not in row_fields)
        self.segments: list[np.ndarray] = []
        self.rows: list[tuple] = []
        self.chunks: dict[str, list] = {n: [] for n in self.chunk_fields}

    def _close_open(self) -> None:
        lens = set()
        if self.row_fields and self.rows:
            lens.add(len(self.rows))
        cols = {}
        for n in self.chunk_fields:
            if self.chunks[n]:
                cols[n] = np.concatenate(self.chunks[n])
                lens.add(len(cols[n]))
                self.chunks[n] = []
        if not lens:
            return
        if len(lens) != 1 or (self.row_fields and not self.rows) or len(cols) != len(self.chunk_fields):
            raise ValueError(f"trace writer: fields of {self.table.path} have different lengths")
        a = np.empty(lens.pop(), self.dtype)
        if self.rows:
            r = np.array(self.rows, dtype=self.row_dtype)
            for n in self.row_fields:
                a[n] = r[n]
            self.rows = []
        for n, v in cols.items():
            a[n] = v
        self.segments.append(a)

    def add_records(self, records: np.ndarray) -> None:
        self._close_open()
        self.segments.append(records)

    def move_to(self, other: "_Buffer") -> None:
        # Appending our open part to the other's open part keeps the order: it
        # follows the other's segments, and our segments are closed first.
        if self.segments:
            other._close_open()
            other.segments.extend(self.segments)
            self.segments = []
        other.rows.extend(self.rows)
        self.rows = []
        for n in self.chunk_fields:
            if self.chunks[n]:
                other.chunks[n].extend(self.chunks[n])
                self.chunks[n] = []

    def take(self) -> np.ndarray | None:
        self._close_open()
        if not self.segments:
            return None
        out = self.segments[0] if len(self.segments) == 1 else np.concatenate(self.segments)
        self.segments = []
        return out


# Fields filled per event as row tuples; the others come as array chunks.
_ROW_FIELDS = {
    "steps": S.STEPS.names,
    "slices": S.SLICES.names,
    "kernels": S.KERNELS_T.names,
    "kv/writes": S.KV_WRITES.names,
    "tokens": ("step", "request", "position", "token", "spec"),
    "request_events": S.REQUEST_EVENTS_T.names,
}


class _Sink:
    """One table's dataset while streaming: cached handles, capacity grown ahead in
    whole chunks (set_extent is rare), records written with one low-level call."""

    def __init__(self, d: h5py.Dataset):
        self.id = d.id
        self.mtype = h5py.h5t.py_create(d.dtype)
        self.chunk = d.chunks[0]
        self.cap = d.shape[0]
        self.space = self.id.get_space()

    def write(self, n0: int, records: np.ndarray) -> None:
        n = len(records)
        if n0 + n > self.cap:
            self.cap = -(-(n0 + n) // self.chunk) * self.chunk + 3 * self.chunk
            self.id.set_extent((self.cap,))
            self.space = self.id.get_space()
        self.space.select_hyperslab((n0,), (n,))
        self.id.write(h5py.h5s.create_simple((n,)), self.space, np.ascontiguousarray(records), mtype=self.mtype)


class TraceWriter(Observer):
    """Observer that writes one run to `path` (parent directories are created).

        with TraceWriter("traces/serial.h5", top_k=8) as w:
            engine.observers = [w]
            engine.run(requests, "serial")

    top_k: logits kept per token (best first). kv_hashes: ask the engine for the
    per-position KV hashes. flush_seconds: how long a closed step may wait in
    memory (0: on_step writes it). compact: rewrite a completed trace compressed.
    A run that does not end with on_run_end(True) (an exception in the `with`
    block, a kill) leaves a readable trace marked completed=False.
    """

    wants_kernels = True
    wants_topk = True

    def __init__(self, path, *, top_k: int = 8, kv_hashes: bool = True, flush_seconds: float = FLUSH_SECONDS,
                 compact: bool = True):
        if int(top_k) < 1:
            raise DivergenceInputError(f"top_k must be >= 1, got {top_k}")
        self.path = Path(path)
        self.top_k = int(top_k)
        self.wants_kv_hashes = bool(kv_hashes)
        self.flush_seconds = float(flush_seconds)
        self.compact = compact
        self.f: h5py.File | None = None
        self._dtypes = {t.path: t.dtype(self.top_k) for t in S.TABLES}
        self._cur = self._buffers()  # the step in progress (engine thread only)
        self._pending = self._buffers()  # closed steps, not yet written (under _lock)
        self._pending_since: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None
        self._error: BaseException | None = None
        self._rows = {t.path: 0 for t in S.TABLES}  # records handed to buffers so far, per table
        self._written = dict(self._rows)  # records written and committed, per table
        self._sinks: dict[str, _Sink] = {}
        self._req: dict[str, int] = {}
        self._model, self._phase = _codes(S.MODELS), _codes(S.PHASES)
        self._op, self._kernel, self._kind = _codes(S.OPS), _codes(S.KERNELS), _codes(S.REQUEST_EVENTS)
        self._last_flush = 0.0
        self._started = False
        self._legacy: dict = {}

    def _buffers(self) -> dict[str, _Buffer]:
        return {t.path: _Buffer(t, self._dtypes[t.path], _ROW_FIELDS.get(t.path, ())) for t in S.TABLES}

    # -- context manager: an exception inside leaves a file marked incomplete --
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close(completed=False if exc[0] is not None else None)
        return False

    @property
    def committed_steps(self) -> int:
        """Steps a reader of the file can see now (written and committed)."""
        return self._written["steps"]

    # -- run start: everything known up front, then SWMR ------------------------------
    def on_run_start(self, info: RunInfo) -> None:
        if self._started:
            raise RuntimeError("a TraceWriter records one run")
        self._started = True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = self.f = h5py.File(self.path, "w", libver="latest")
        try:
            self._write_header(f, info)
            for t in S.TABLES:
                _create_table(f, t, self.top_k, chunk_bytes=S.STREAM_CHUNK_BYTES)
            _create_status(f, np.zeros(len(S.STATUS_FIELDS), np.int64))
            f.swmr_mode = True
            f.flush()
            self._sinks = {t.path: _Sink(f[t.path]) for t in S.TABLES}
        except BaseException:
            f.close()
            self.f = None
            raise
        self._last_flush = time.monotonic()
        if self.flush_seconds > 0:
            self._timer = threading.Thread(target=self._tick, name="trace-flush", daemon=True)
            self._timer.start()

    def _write_header(self, f: h5py.File, info: RunInfo) -> None:
        a = f.attrs
        a["format"] = S.FORMAT
        a["schema_version"] = S.SCHEMA_VERSION
        a["schema_minor"] = S.SCHEMA_MINOR
        a["created"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        a["schedule"] = str(info.schedule)
        a["policy"] = str(info.policy)
        a["top_k"] = self.top_k
        a["kv_hashes"] = self.wants_kv_hashes
        a["kv_hash"] = S.KV_HASH
        a["description"] = ("divergence trace: one engine run (docs/trace-format.md); /status says whether it "
                            "completed and how many records of each table are committed")
        meta = f.create_group(S.META)
        meta.attrs["description"] = "JSON strings: run settings, target model, draft model (null), environment"
        for k in ("settings", "model", "draft", "environment"):
            meta.attrs[k] = _json(getattr(info, k))
        self._write_requests(f, info.requests)
        pieces = [str(p).encode("utf-8", "surrogatepass") for p in info.vocab]
        if pieces:
            # bytes + offsets, not vlen strings: token text may hold NUL characters
            g = f.create_group(S.VOCAB)
            g.attrs["description"] = "text of token i decoded alone: bytes[offsets[i]:offsets[i+1]], utf-8"
            g.create_dataset("bytes", data=np.frombuffer(b"".join(pieces), np.uint8))
            g.create_dataset("offsets", data=np.concatenate([[0], np.cumsum([len(p) for p in pieces])]).astype(np.int64))

    def _write_requests(self, f: h5py.File, requests) -> None:
        g = f.create_group(S.REQUESTS)
        g.attrs["description"] = "the requests of the run, in the order given; other tables refer to rows here"
        ids = [str(r.id) for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("trace writer: request ids must be unique")
        self._req = {rid: i for i, rid in enumerate(ids)}
        lens = [len(r.prompt_tokens) for r in requests]
        flat = np.concatenate([np.asarray(r.prompt_tokens, np.int32) for r in requests]) if requests else []
        cols = {
            "id": (np.array(ids, dtype=h5py.string_dtype()), "request id", ""),
            "prompt_offsets": (np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
                               "prompt of request i: prompt_tokens[prompt_offsets[i]:prompt_offsets[i+1]]", ""),
            "prompt_tokens": (np.asarray(flat, np.int32), "prompt token ids, concatenated", ""),
            "arrival": (np.array([r.arrival for r in requests], np.int32),
                        "engine step at which the request arrives", "step"),
            "max_tokens": (np.array([r.max_tokens for r in requests], np.int32), "tokens to generate at most",
                           "tokens"),
            "temperature": (np.array([r.sampling.temperature for r in requests], np.float64), "0 = greedy", ""),
            "top_p": (np.array([r.sampling.top_p for r in requests], np.float64), "nucleus sampling mass", ""),
            "seed": (np.array([r.sampling.seed for r in requests], np.int64), "sampling seed", ""),
        }
        for name, (data, desc, units) in cols.items():
            d = g.create_dataset(name, data=data)
            d.attrs["description"] = desc
            if units:
                d.attrs["units"] = units

    def _rid(self, request_id: str) -> int:
        try:
            return self._req[request_id]
        except KeyError:
            raise ValueError(f"trace writer: request {request_id!r} is not in RunInfo.requests") from None

    # -- events of the step in progress -----------------------------------------------
    def on_kernel(self, c: KernelChoice) -> None:
        try:
            row = (c.step, self._model[c.model], c.layer, self._op[c.op], c.rows, self._kernel[c.kernel], c.m, c.n,
                   c.k, c.splits)
        except KeyError:
            S.code(S.MODELS, c.model, "model"), S.code(S.OPS, c.op, "op"), S.code(S.KERNELS, c.kernel, "kernel")
            raise
        self._cur["kernels"].rows.append(row)
        self._rows["kernels"] += 1

    def on_kv_write(self, w: KvWrite) -> None:
        k = np.asarray(w.k_hashes, np.uint64).reshape(-1)
        v = np.asarray(w.v_hashes, np.uint64).reshape(-1)
        if len(k) != w.count or len(v) != w.count:
            raise ValueError(f"trace writer: KV write of {w.count} positions carries {len(k)}/{len(v)} hashes")
        model = self._model.get(w.model)
        if model is None:
            S.code(S.MODELS, w.model, "model")
        self._cur["kv/writes"].rows.append((w.step, model, self._rid(w.request_id), w.layer, w.start, w.count,
                                            self._rows["kv/hashes"]))
        self._rows["kv/writes"] += 1
        h = self._cur["kv/hashes"].chunks
        h["k_hash"].append(k)
        h["v_hash"].append(v)
        self._rows["kv/hashes"] += w.count

    def on_token(self, e: TokenEvent) -> None:
        b = self._cur["tokens"]
        b.rows.append((e.step, self._rid(e.request_id), e.position, e.token, e.spec))
        ids, vals = np.asarray(e.topk_ids), np.asarray(e.topk_logits)
        if ids.shape != (self.top_k,) or vals.shape != (self.top_k,):
            ids, vals = _fit_topk(ids, vals, self.top_k)
        b.chunks["topk_ids"].append(ids[None])  # [1, K]
        b.chunks["topk_logits"].append(vals[None])
        self._rows["tokens"] += 1

    def on_request(self, e: RequestEvent) -> None:
        kind = self._kind.get(e.kind)
        if kind is None:
            S.code(S.REQUEST_EVENTS, e.kind, "request event")
        detail = str(e.detail or "").encode("utf-8", "surrogatepass")
        self._cur["request_events"].rows.append((e.step, self._rid(e.request_id), kind,
                                                 self._rows["request_event_detail"], len(detail)))
        self._rows["request_events"] += 1
        if detail:
            self._cur["request_event_detail"].chunks["byte"].append(np.frombuffer(detail, np.uint8))
            self._rows["request_event_detail"] += len(detail)

    def on_step(self, e: StepEvent) -> None:
        """Closes the step: its records become one unit that a reader sees whole or not at all."""
        plan = e.plan
        cur, rows = self._cur, self._rows
        model = self._model.get(plan.model)
        if model is None:
            S.code(S.MODELS, plan.model, "model")
        sl, toks, lrows = cur["slices"].rows, cur["slice_tokens"].chunks["token"], cur["slice_logit_rows"].chunks["row"]
        for s in plan.slices:
            phase = self._phase.get(s.phase)
            if phase is None:
                S.code(S.PHASES, s.phase, "phase")
            if len(s.tokens) != s.count:
                raise ValueError(f"trace writer: slice of {s.request_id!r} has {s.count} rows but "
                                 f"{len(s.tokens)} tokens")
            sl.append((plan.index, self._rid(s.request_id), phase, s.start, s.count, s.row_offset,
                       rows["slice_tokens"], rows["slice_logit_rows"], len(s.logit_rows)))
            toks.append(np.asarray(s.tokens, np.int32))
            rows["slice_tokens"] += s.count
            if s.logit_rows:
                lrows.append(np.asarray(s.logit_rows, np.int32))
                rows["slice_logit_rows"] += len(s.logit_rows)
        cur["steps"].rows.append((plan.index, model, e.duration_s, plan.rows, rows["slices"], len(plan.slices)))
        rows["slices"] += len(plan.slices)
        rows["steps"] += 1
        self._close_step()
        if self.flush_seconds <= 0 or time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()

    def _close_step(self) -> None:
        with self._lock:
            for name, b in self._cur.items():
                b.move_to(self._pending[name])
            if self._pending_since is None:
                self._pending_since = time.monotonic()

    # -- bulk appends (tools and tests that build traces without an engine) -------------
    def append(self, table: str, **columns) -> None:
        """Append records to one table from arrays (scalars broadcast): every field
        of the table, offsets included (hash_offset, token_offset, ... are the
        caller's). They are committed with the next flush; mixing with events is fine."""
        t = S.TABLE[table]
        if set(columns) != set(t.names):
            raise ValueError(f"trace writer: {table} needs fields {', '.join(t.names)}; "
                             f"got {', '.join(sorted(columns))}")
        lens = {len(v) for v in columns.values() if np.ndim(v) > 0}
        if len(lens) > 1:
            raise ValueError(f"trace writer: fields of {table} have different lengths {sorted(lens)}")
        n = lens.pop() if lens else 1
        records = np.empty(n, self._dtypes[table])
        for name in t.names:
            records[name] = columns[name]
        with self._lock:
            self._pending[table].add_records(records)
            if self._pending_since is None:
                self._pending_since = time.monotonic()
        self._rows[table] += n

    # -- writing -------------------------------------------------------------------------
    def _tick(self) -> None:
        while not self._stop.wait(self.flush_seconds / 2):
            since = self._pending_since
            if since is not None and time.monotonic() - since >= self.flush_seconds:
                try:
                    self.flush()
                except BaseException as e:  # raised in the engine thread by its next flush
                    self._error = e
                    return

    def flush(self) -> None:
        """Write and commit every closed step now."""
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        with self._lock:
            f = self.f
            if f is None:
                return
            counts = dict(self._written)
            for t in S.TABLES:  # /steps last
                records = self._pending[t.path].take()
                if records is not None:
                    self._sinks[t.path].write(counts[t.path], records)
                    counts[t.path] += len(records)
            self._pending_since = None
            if counts != self._written:
                f.flush()  # the records first ...
                self._write_status(counts, completed=False)
                f.flush()  # ... then the counts that make them visible
                self._written = counts
            self._last_flush = time.monotonic()

    def _write_status(self, counts: dict, *, completed: bool) -> None:
        st = np.array([int(completed)] + [counts[t.path] for t in S.TABLES], np.int64)
        self.f[S.STATUS].id.write(h5py.h5s.ALL, h5py.h5s.ALL, st)

    def on_run_end(self, completed: bool) -> None:
        self.close(completed=bool(completed))

    def close(self, *, completed: bool | None = None) -> None:
        """Write what is left and close. completed=True marks the trace complete (and
        compacts it); False or None leave it marked incomplete."""
        if self._timer is not None:
            self._stop.set()
            self._timer.join()
            self._timer = None
        if self.f is None:
            return
        try:
            if completed:
                self._drain_legacy()
                self._close_step()  # events after the last step (final request events)
            else:  # a step cut short: keep its request events (errors), drop its half-made records
                with self._lock:
                    for name in ("request_events", "request_event_detail"):
                        self._cur[name].move_to(self._pending[name])
            self.flush()
            if completed and not self.compact:
                for t in S.TABLES:  # trim the capacity grown ahead
                    self._sinks[t.path].id.set_extent((self._written[t.path],))
                self._write_status(self._written, completed=True)
                self.f.flush()
        finally:
            self.f.close()
            self.f = None
        if completed and self.compact:
            compact(self.path)

    # -- legacy column buffers: tests/tui/story.py fills them directly (use append) -------
    @property
    def tables(self) -> dict:
        return _LegacyTables(self._legacy)

    @property
    def _topk_ids(self):
        return self.tables["tokens"].cols.setdefault("topk_ids", [])

    @_topk_ids.setter
    def _topk_ids(self, rows):
        self.tables["tokens"].cols["topk_ids"] = list(rows)

    @property
    def _topk_logits(self):
        return self.tables["tokens"].cols.setdefault("topk_logits", [])

    @_topk_logits.setter
    def _topk_logits(self, rows):
        self.tables["tokens"].cols["topk_logits"] = list(rows)

    def _drain_legacy(self) -> None:
        renamed = {"slices/input_tokens": ("slice_tokens", "token"), "slices/logit_rows": ("slice_logit_rows", "row")}
        for name, t in self._legacy.items():
            if not any(t.cols.values()):
                continue
            if name in renamed:
                table, col = renamed[name]
                self.append(table, **{col: np.asarray(t.cols["value"])})
            else:
                self.append(name, **{k: np.asarray(v) for k, v in t.cols.items()})
        self._legacy = {}


class _LegacyTable:
    def __init__(self):
        self.cols: dict[str, list] = {}

    def extend(self, name: str, values) -> None:
        self.cols.setdefault(name, []).extend(values)


class _LegacyTables(dict):
    def __init__(self, store: dict):
        super().__init__()
        self.store = store

    def __getitem__(self, name):
        return self.store.setdefault(name, _LegacyTable())


def _fit_topk(ids: np.ndarray, vals: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Pad (past the vocabulary) or cut top-k rows to exactly k entries."""
    ids, vals = ids.reshape(-1)[:k], vals.reshape(-1)[:k]
    out_i = np.full(k, S.TOPK_PAD_ID, np.int32)
    out_v = np.full(k, S.TOPK_PAD_LOGIT, np.float32)
    out_i[: len(ids)] = ids
    out_v[: len(vals)] = vals
    return out_i, out_v


def _create_table(f: h5py.File, t: S.Table, top_k: int, *, chunk_bytes: int, data: np.ndarray | None = None,
                  compression: str | None = None) -> None:
    dtype = t.dtype(top_k)
    n = 0 if data is None else len(data)
    rows = max(64, chunk_bytes // dtype.itemsize)
    if data is not None:
        rows = max(1, min(rows, n))
    kw = {}
    if compression is not None:
        kw = dict(compression=compression, compression_opts=S.COMPRESSION_OPTS, shuffle=dtype.itemsize > 1)
    if "/" in t.path:
        g = f.require_group(t.path.rsplit("/", 1)[0])
        g.attrs["description"] = "the KV cache: writes and per-position hashes of their bytes"
    d = f.create_dataset(t.path, shape=(n,), maxshape=(None,), dtype=dtype, chunks=(rows,), data=data, **kw)
    d.attrs["description"] = t.description
    d.attrs["fields"] = list(t.names)
    for c in t.columns:
        d.attrs[f"field:{c.name}"] = c.description
        if c.units:
            d.attrs[f"units:{c.name}"] = c.units
        if c.codes is not None:
            d.attrs[f"codes:{c.name}"] = list(c.codes)


def _create_status(f: h5py.File, values: np.ndarray) -> None:
    st = f.create_dataset(S.STATUS, data=values)
    st.attrs["description"] = ("completed flag (1 once the run completed), then the committed records of each "
                               "table: records past them are not part of the trace")
    st.attrs["fields"] = list(S.STATUS_FIELDS)


def compact(path) -> None:
    """Rewrite a finished trace compressed, with chunks fitted to the data, and mark
    it completed: a temporary file beside it replaces it only once whole."""
    from .reader import read_status

    path = Path(path)
    tmp = path.with_name(path.name + ".compacting")
    try:
        with h5py.File(path, "r") as src, h5py.File(tmp, "w") as dst:
            counts = read_status(src)
            for k, v in src.attrs.items():
                dst.attrs[k] = v
            for name in (S.META, S.REQUESTS, S.VOCAB):
                if name in src:
                    src.copy(src[name], dst, name=name)
            top_k = int(src.attrs["top_k"])
            for t in S.TABLES:
                _create_table(dst, t, top_k, chunk_bytes=S.FINAL_CHUNK_BYTES, compression=S.COMPRESSION,
                              data=src[t.path][: counts[t.path]])
            _create_status(dst, np.array([1] + [counts[t.path] for t in S.TABLES], np.int64))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        # the streamed file holds every record: mark it completed there instead
        with h5py.File(path, "r+") as f:
            f[S.STATUS][0] = 1
        raise
