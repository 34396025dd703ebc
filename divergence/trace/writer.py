"""Streams engine events into an HDF5 trace (h5py, SWMR); the file's writes off the engine's thread.

On the engine thread an event costs one list append, and every ENCODE_STEPS steps
the batch is encoded into record arrays (encode.py) there: events then live a few
steps (see _encode). The records go to a flush thread, which writes their whole
chunks into the table bodies at once while the engine computes (MLX waits without
the GIL): every EXTEND_SECONDS, so that a run shorter than that wakes it only to
create the file, and its close writes the lot at once, on the engine thread. Every
FLUSH_SECONDS (or FLUSH_STEPS steps) the thread writes each extended table's rows
past its last whole chunk into a tail slot (layout.py), flushes the file, then writes
the commit record and flushes it: readers see whole flushes only, so a run killed
with SIGKILL leaves a readable file holding every flushed step, marked incomplete
(`durable_steps` says how many are on disk).
"""
from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

import numpy as np

from ..core.events import (
    AllReduce, KernelChoice, KvWrite, Observer, RequestEvent, Routing, RunInfo, StepEvent, StepKernels, StepKvWrites,
    TokenEvent,
)
from ..errors import TraceError
from . import layout, reserve
from .failure import abandon as _abandon, flushes as _flushes, reason as _reason
from . import schema as S
from .encode import Batch, Cols, Encoder
from .h5lock import H5_LOCK

FLUSH_SECONDS = 0.5
FLUSH_STEPS = 256
ENCODE_STEPS = 8  # steps whose events are encoded at once, on the engine thread (see on_step)
EXTEND_SECONDS = 0.25  # records handed to the flush thread between writes no more often than this
_OFFSETS = {"steps": ("slice_offset",), "slices": ("token_offset", "logit_offset"), "kv_writes": ("hash_offset",),
            "routing": ("choice_offset",)}
QUEUE_BATCHES = 32  # hand-offs the flush thread may lag behind before the engine waits (bounded memory)


class TraceWriter(Observer):
    """Observer that writes one run to `path`. Use as a context manager.

    `append(table, **columns)` (or `on_record`) adds records to any table of
    schema.TABLES: columns are arrays of one length or scalars (broadcast); names
    are accepted for code columns and request ids for `request`. `widths` sizes 2-D
    columns not known from the run (default: `top_k`, the model config's
    `num_experts_per_tok`). With background=False the flushes run on the caller's thread.

    kv_hash: the name of the 64-bit hash in /kv_hashes (another engine may use its own);
    ops / kernels: names beyond the core tables (another engine's own op and kernel
    labels), appended to the file's code tables: readers decode with the file's tables.
    mode: the trace's permission bits from its creation on (the server's 0o600), else the umask's.
    """

    wants_kernels = True
    wants_routing = True
    wants_records = True

    def __init__(self, path, *, top_k: int = 8, kv_hashes: bool = True, kv_hash: str = S.HASH_NAME, ops=(),
                 kernels=(), widths: dict | None = None, background: bool = True, mode: int | None = None):
        self.path = Path(path)
        self.mode = mode
        self.top_k = top_k
        self.wants_kv_hashes = kv_hashes
        self.kv_hash = kv_hash
        self.code_tables = dict(S.CODE_TABLES)
        for key, extra in (("ops", ops), ("kernels", kernels)):
            base = S.CODE_TABLES[key]
            self.code_tables[key] = tuple(base) + tuple(o for o in dict.fromkeys(extra) if o not in base)
        self.background = background
        self._widths = dict(widths or {})
        self.f = None
        self.tables: dict[str, layout.TableFile] = {}
        self._req_index: dict[str, int] = {}
        self._live_prompt_rows = 0  # rows of /live_prompt_tokens so far
        self._batch = Batch()  # events since the last encoding
        self._out = _Records()  # their records, encoded since the last hand-off
        self._last_write = 0.0  # when the engine last asked for a write (perf_counter)
        self._last_handoff = 0.0  # when the engine last handed a batch off (perf_counter)
        self._unwritten = 0  # steps handed off since then
        self._dirty: dict[str, None] = {}  # tables extended since the last commit (flush thread)
        self._encoded_steps = 0  # steps encoded since then
        self.durable_steps = 0  # steps on disk (set by the flush thread after each file flush)
        self._closing_steps = 0  # the closing hand-off's steps: on disk once close commits them
        self._started = False
        self._error: BaseException | None = None
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._reserve = None  # trace/reserve.py: room for HDF5 to finish with, held while the file is open

    # -- context manager: a crash inside still leaves a file marked incomplete --
    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        self.close(completed=None, raise_errors=exc_type is None)
        return False

    def on_run_start(self, info: RunInfo) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        config = (info.model or {}).get("config") or {}
        widths = {"top_k": self.top_k}
        for key in {c.width for t in S.TABLES.values() for c in t.columns.values() if isinstance(c.width, str)}:
            v = self._widths.get(key, (info.settings or {}).get(key, config.get(key)))
            if isinstance(v, int) and v > 0:
                widths.setdefault(key, v)
        dtypes = {name: S.record_dtype(t, widths) for name, t in S.TABLES.items()}
        self._create = lambda: layout.create(self.path, info, top_k=self.top_k, kv_hashes=self.wants_kv_hashes,
                                             kv_hash=self.kv_hash, codes=self.code_tables, widths=widths,
                                             dtypes=dtypes, mode=self.mode)
        self._req_index = {r.id: i for i, r in enumerate(info.requests)}
        self._encoder = Encoder(dtypes, self._req_index, self.code_tables)
        self._last_write = self._last_handoff = time.perf_counter()
        self._started = True
        if self.background:  # the file is created on the flush thread too, while the engine starts
            self._queue = queue.Queue(QUEUE_BATCHES)
            self._thread = threading.Thread(target=self._flush_loop, name=f"trace-writer:{self.path.name}",
                                            daemon=True)
            self._thread.start()
        else:
            self._open()

    def _open(self) -> None:
        self._reserve = reserve.take(self.path)  # room for HDF5 to close the file should the disk fill
        with H5_LOCK:
            self.f, self.tables, self._commit = self._create()

    # -- events: one list append each on the engine thread ------------------------------
    def on_kernel(self, c: KernelChoice) -> None:
        self._batch.add("kernels", c)

    def on_kernels(self, cs: list[KernelChoice]) -> None:
        """A step's kernel choices in one call (the engine's, at collect: a StepKernels, kept
        whole and encoded from its rows); a list: on_kernel each."""
        if type(cs) is StepKernels:
            self._batch.add("kernels", cs)
            return
        b = self._batch
        lst = b.items.get("kernels")
        if lst is None:
            b.items["kernels"] = list(cs)
        else:
            lst.extend(cs)

    def on_allreduce(self, e: AllReduce) -> None:
        self._batch.add("allreduce", e)

    def on_kv_write(self, w: KvWrite) -> None:
        self._batch.add("kv_writes", w)

    def on_kv_writes(self, ws: list[KvWrite]) -> None:
        if type(ws) is StepKvWrites:  # the engine's: kept whole, encoded from its columns
            self._batch.add("kv_writes", ws)
            return
        lst = self._batch.items.get("kv_writes")
        if lst is None:
            self._batch.items["kv_writes"] = list(ws)
        else:
            lst.extend(ws)

    def on_routing(self, r: Routing) -> None:
        self._batch.add("routing", r)

    def on_token(self, e: TokenEvent) -> None:
        self._batch.add("tokens", e)

    def on_request(self, e: RequestEvent) -> None:
        if e.request_id in self._req_index:
            self._batch.add("request_events", e)

    def on_request_added(self, request) -> None:
        """A request that joined after the run started (a live server's): its row in /live_requests,
        its index next after the ones known so far, before any event names it."""
        if request.id in self._req_index:
            raise ValueError(f"request {request.id!r} is already in {self.path}")
        rid = request.id.encode("ascii")
        if len(rid) > 64:
            raise ValueError(f"request id {request.id!r} is longer than 64 bytes")
        i = len(self._req_index)
        self._req_index[request.id] = i
        self._encoder.req[request.id] = i  # (the encoder keeps its own copy of the index)
        s = request.sampling
        self._batch.add("live_requests", Cols(dict(
            id=rid, prompt_offset=self._live_prompt_rows, prompt_count=len(request.prompt_tokens),
            arrival=request.arrival, max_tokens=request.max_tokens, temperature=s.temperature, top_p=s.top_p,
            seed=s.seed)))
        self._batch.add("live_prompt_tokens", Cols(dict(value=np.asarray(request.prompt_tokens, np.int32))))
        self._live_prompt_rows += len(request.prompt_tokens)

    def append(self, table: str, **columns) -> None:
        """Records of any table; see the class docstring."""
        spec = S.TABLES.get(table)
        if spec is None:
            raise KeyError(f"no trace table {table!r} (tables: {', '.join(S.TABLES)})")
        bad = set(columns) - set(spec.columns)
        if bad:
            raise KeyError(f"table {table!r} has no column {sorted(bad)[0]!r} (columns: {', '.join(spec.columns)})")
        missing = [c for c in _OFFSETS.get(table, ()) if c not in columns]
        if missing:  # events keep these running; bulk records must bring their own (and not mix with events)
            raise ValueError(f"appending to {table!r} needs {', '.join(missing)} (or use on_step / on_kv_write)")
        self._batch.add(table, Cols(columns))

    def on_record(self, table: str, **columns) -> None:
        self.append(table, **columns)

    def on_step(self, e: StepEvent) -> None:
        b = self._batch
        b.add("steps", e)
        b.steps += 1
        if b.steps >= ENCODE_STEPS:
            self._encode()
        now = time.perf_counter()
        if now - self._last_write >= FLUSH_SECONDS or self._unwritten + self._out.steps + b.steps >= FLUSH_STEPS:
            self._handoff(wait=False)
        elif self._out.steps and now - self._last_handoff >= EXTEND_SECONDS:
            self._handoff(wait=False, write=False)

    def flush(self) -> None:
        """Everything emitted so far is on disk when this returns."""
        if self._started:
            self._handoff(wait=True)

    # -- hand-off and the flush thread -----------------------------------------------------
    def _encode(self) -> None:
        """The events since the last encoding into records, on this thread: an event lives a
        few steps, not until the flush thread's next turn or the close (held that long, a
        run's events all outlive a young-generation collection, and every few runs the
        cyclic GC then scans the whole heap, a pause as long as a short run's steps). Records
        are numpy arrays, which the GC does not track."""
        batch, self._batch = self._batch, Batch()
        self._raise_if_failed()
        try:
            encoded = self._encoder.encode(batch)
        except Exception as e:  # as a failed write: one TraceError, what is on disk stays readable
            self._error = e
            self._raise_if_failed()
        out = self._out
        for name, arrs in encoded.items():
            got = out.tables.get(name)
            if got is None:
                out.tables[name] = arrs
            else:
                got.extend(arrs)
        out.steps += batch.steps

    def _handoff(self, *, wait: bool, last: bool = False, write: bool = True) -> None:
        """The records encoded so far to be written (to the flush thread when there is one);
        write=False: only extended into the bodies, their rows committed with the next write."""
        self._raise_if_failed()
        if (write or last) and (self._batch.items or self._batch.steps):
            self._encode()
        out, self._out = self._out, _Records()
        out.last, out.write = last, write or last
        now = self._last_handoff = time.perf_counter()
        if out.write:
            self._last_write, self._unwritten = now, 0
        else:
            self._unwritten += out.steps
        if self._queue is None:
            try:
                self._write(out)
            except Exception as e:  # as on the flush thread: one TraceError, what is on disk stays readable
                self._error = e
        else:
            self._queue.put(out)
            if wait:
                self._queue.join()
        self._raise_if_failed()

    def _flush_loop(self) -> None:
        q = self._queue
        try:
            self._open()
        except BaseException as e:  # surfaced on the engine thread at its next hand-off
            self._error = e
        while True:
            batch = q.get()
            try:
                if batch is None:
                    return
                if self._error is None:  # after a failure, drop the rest: what is on disk stays readable
                    self._write(batch)
            except BaseException as e:  # surfaced on the engine thread at its next hand-off
                self._error = e
            finally:
                q.task_done()

    def _write(self, out: "_Records") -> None:
        # on the flush thread, give the GIL back between tables: the engine thread wants it
        # the moment its step's compute returns, and would otherwise wait up to the
        # interpreter's switch interval (5 ms) behind a whole hand-off's writes
        pause = _let_engine_in if threading.current_thread() is self._thread else _no_pause
        self._encoded_steps += out.steps
        with H5_LOCK:  # whole chunks into the bodies now, while the engine computes: not at the close
            for name, arrs in out.tables.items():
                self.tables[name].extend(arrs[0] if len(arrs) == 1 else layout.concat(arrs), last=out.last)
                self._dirty[name] = None
                pause()
            if not out.write or not self._dirty:
                return
            steps, self._encoded_steps = self._encoded_steps, 0
            dirty, self._dirty = self._dirty, {}
            if out.last:  # close flushes and commits once, after finishing the tables
                self._closing_steps = steps
                return
            for name in dirty:
                self.tables[name].write_tail()
            self.f.flush()  # the records on disk before the commit names them (HDF5 orders no metadata)
            self._commit.write()
        self.durable_steps += steps

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            e = self._error
            raise TraceError(f"writing {self.path} failed: {_reason(e)}") from e

    # -- the end -------------------------------------------------------------------------
    def on_run_end(self, completed: bool) -> None:
        self.close(completed=completed)

    def close(self, *, completed: bool | None, raise_errors: bool = True) -> None:
        """Finish and close the file, once. A failed write (a full disk) is one TraceError;
        the h5py file is closed exactly once even then, and dropped (no second close at exit)."""
        if not self._started:
            return
        self._started = False
        error = None
        try:
            # the last batch on this thread, once the flush thread is done with the ones before
            # it: no hand-off to wait on, and no wake-up of a thread the GIL is then shared with
            self._stop_thread()
            self._handoff(wait=True, last=True)
        except TraceError as e:
            error = e
        finally:
            self._stop_thread()
            f, self.f = self.f, None
            if f is not None:
                with H5_LOCK:
                    try:
                        if error is None:
                            try:  # tails into the bodies: a closed trace is plain tables
                                for t in self.tables.values():
                                    t.finish()
                                f.flush()
                                self._commit.write()
                                self.durable_steps += self._closing_steps
                                if completed:  # (close flushes it: a flush of its own would be one more per trace)
                                    self._commit.completed()
                            except Exception as e:  # noqa: BLE001  (h5py raises OSError or RuntimeError)
                                error = self._failure(e)
                    finally:
                        if error is None or _flushes(f):
                            try:
                                f.close()
                            except Exception as e:  # noqa: BLE001  (its last flush failed too)
                                if error is None:
                                    error = self._failure(e)
                        else:  # HDF5 still holds data it cannot write: closing it (or GC) would crash
                            _abandon(f)
                        self.tables, self._commit = {}, None
            reserve.release(self._reserve)
            self._reserve = None
        if error is not None and raise_errors:
            raise error

    def _failure(self, e: BaseException) -> TraceError:
        self._error = self._error or e
        err = TraceError(f"writing {self.path} failed: {_reason(e)}")
        err.__cause__ = e
        return err

    def _stop_thread(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
            self._queue = None


class _Records:
    """Records of some steps, encoded on the engine thread, for one hand-off."""

    __slots__ = ("tables", "steps", "last", "write")

    def __init__(self):
        self.tables: dict[str, list[np.ndarray]] = {}  # table -> record arrays, in order
        self.steps = 0  # StepEvents they hold
        self.last = False  # the closing hand-off: nothing follows it
        self.write = True  # write (and commit) everything so far; False: into the bodies only


def _let_engine_in() -> None:
    time.sleep(0)  # releases the GIL: a thread waiting for it takes it first


def _no_pause() -> None:
    pass
