"""Reading traces: lazy, numpy out, robust to files of killed or running runs.

    with Trace.open("traces/serial.h5") as t:
        t.tokens("r1").topk_logits      # float32 [n, K], exact
        t.step_plan(7)                  # the StepPlan replay re-executes
        t.live_kv("r1", at_step=40)     # which write each (layer, position) read at step 40

Tables are read whole on first use and cached; `refresh()` drops the caches (a
trace still being written then shows its newer steps). Only the rows that
/status counts as committed are read: a killed run's half-written batch is never
seen.
"""
from __future__ import annotations

import ctypes
import glob
import json
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Iterator, NamedTuple

import h5py
import numpy as np

from ..engine.events import SeqSlice, StepPlan
from ..engine.request import Sampling
from ..errors import TraceError
from . import schema as S

# A SWMR reader retries a failed metadata checksum (a writer may be mid-flush)
# with growing sleeps, 100 times by default: minutes on a damaged file. A few suffice.
SWMR_READ_ATTEMPTS = 8


@dataclass(frozen=True)
class TraceRequest:
    id: str
    prompt_tokens: tuple
    arrival: int
    max_tokens: int
    sampling: Sampling
    status: str = "pending"  # pending | running | finished | error (as far as the trace got)
    finish_reason: str = ""  # finished: eos | length | ...; error: the message
    finish_step: int | None = None


class TokenRecords(NamedTuple):
    positions: np.ndarray  # int32 [n], sorted
    tokens: np.ndarray  # int32 [n]
    steps: np.ndarray  # int64 [n]
    spec: np.ndarray  # int8 [n]: SPEC_NONE | SPEC_ACCEPTED | SPEC_CORRECTED
    topk_ids: np.ndarray  # int32 [n, K]
    topk_logits: np.ndarray  # float32 [n, K]


def read_status(f: h5py.File) -> dict[str, int]:
    """{"completed": 0|1, table path: committed rows} from /status."""
    d = f[S.STATUS]
    if f.swmr_mode:  # refresh only a live file's: it evicts what other handles use
        d.id.refresh()
    values = d[()]
    fields = [x.decode() if isinstance(x, bytes) else str(x) for x in d.attrs["fields"]]
    return {k: int(v) for k, v in zip(fields, values)}


class Trace:
    """One trace file. Open with `Trace.open(path)`; close (or use `with`)."""

    def __init__(self, path: Path, f: h5py.File):
        self.path = path
        self.f = f
        # h5py serializes single calls, not a refresh against another thread's read:
        # every dataset read of a Trace goes through this lock.
        self._lock = threading.RLock()

    # -- opening ---------------------------------------------------------------------
    @classmethod
    def open(cls, path) -> "Trace":
        """Open a trace; TraceError with one clear line if it is not a readable one."""
        p = Path(path)
        if not p.exists():
            raise TraceError(f"no such trace: {p}")
        if p.is_dir():
            raise TraceError(f"{p} is a directory, not a trace file")
        try:
            with open(p, "rb"):
                pass
        except OSError as e:
            raise TraceError(f"cannot read {p}: {e.strerror}") from None
        if not h5py.is_hdf5(p):
            raise TraceError(f"{p} is not an HDF5 file (corrupt, or not a trace)")
        f = _open_h5(p)
        try:
            _check(p, f)
        except TraceError:
            f.close()
            raise
        except Exception as e:  # damaged metadata
            f.close()
            raise TraceError(f"cannot read {p}: damaged trace ({_short(e)})") from None
        return cls(p, f)

    def close(self) -> None:
        with self._lock:  # not under a worker thread's read
            self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self) -> str:
        return f"<Trace {self.path} {self.meta.get('schedule')} steps={self.num_steps} completed={self.completed}>"

    @contextmanager
    def _reading(self, what: str):
        """A cut or damaged file fails here, not at open: one clear TraceError."""
        if not self.f.id.valid:
            raise ValueError(f"read of a closed trace ({self.path})")
        try:
            yield
        except (OSError, RuntimeError, ValueError, KeyError) as e:
            raise TraceError(f"cannot read {self.path}: damaged trace, /{what} ({_short(e)})") from None

    def refresh(self) -> None:
        """Forget cached tables: a trace still being written shows its newer steps."""
        with self._lock:
            for k in [k for k in self.__dict__ if k not in ("path", "f", "_lock")]:
                del self.__dict__[k]

    # -- metadata ----------------------------------------------------------------------
    @cached_property
    def _status(self) -> dict[str, int]:
        with self._lock:
            return read_status(self.f)

    @property
    def schema_version(self) -> int:
        return int(self.f.attrs["schema_version"])

    @property
    def completed(self) -> bool:
        return bool(self._status["completed"])

    @property
    def has_kv_hashes(self) -> bool:
        return bool(self.f.attrs.get("kv_hashes", False))

    @property
    def top_k(self) -> int:
        return int(self.f.attrs["top_k"])

    @cached_property
    def meta(self) -> dict:
        """schedule, policy, created, top_k, completed, settings, model, draft, environment."""
        with self._reading(S.META):
            m = self.f[S.META].attrs
            out = {k: json.loads(m[k]) for k in ("settings", "model", "draft", "environment")}
        for k in ("schedule", "policy", "created", "top_k", "schema_version"):
            v = self.f.attrs.get(k)
            out[k] = v.item() if hasattr(v, "item") else v
        out["completed"] = self.completed
        return out

    @cached_property
    def requests(self) -> list[TraceRequest]:
        with self._reading(S.REQUESTS):
            g = self.f[S.REQUESTS]
            ids = [x.decode() if isinstance(x, bytes) else str(x) for x in g["id"][()]]
            off, flat = g["prompt_offsets"][()], g["prompt_tokens"][()]
            arr, mt = g["arrival"][()], g["max_tokens"][()]
            temp, top_p, seed = g["temperature"][()], g["top_p"][()], g["seed"][()]
        status = self._request_status(len(ids))
        return [TraceRequest(rid, tuple(flat[off[i]: off[i + 1]].tolist()), int(arr[i]), int(mt[i]),
                             Sampling(float(temp[i]), float(top_p[i]), int(seed[i])), *status[i])
                for i, rid in enumerate(ids)]

    def _request_status(self, n: int) -> list[tuple]:
        ev = self._table("request_events")
        raw = self._table("request_event_detail")["byte"].tobytes()
        out = [("pending", "", None)] * n
        arrived, finished, error = (S.REQUEST_EVENTS.index(k) for k in ("arrived", "finished", "error"))
        for step, req, kind, off, cnt in zip(*(ev[c].tolist() for c in S.REQUEST_EVENTS_T.names)):
            if kind == arrived and out[req][0] == "pending":
                out[req] = ("running", "", None)
            elif kind in (finished, error):
                out[req] = ("finished" if kind == finished else "error",
                            raw[off: off + cnt].decode("utf-8", "replace"), step)
        return out

    @cached_property
    def _request_ids(self) -> dict[str, int]:
        return {r.id: i for i, r in enumerate(self.requests)}

    def request_index(self, request_id: str) -> int:
        try:
            return self._request_ids[request_id]
        except KeyError:
            raise KeyError(f"no request {request_id!r} in {self.path}") from None

    def finish_step(self, request_id: str) -> int | None:
        """Step at which the request finished (or failed); None if it did not in this trace."""
        return self.requests[self.request_index(request_id)].finish_step

    @cached_property
    def vocab(self) -> list[str] | None:
        """Text of each token id decoded alone, or None if the run did not record it."""
        if S.VOCAB not in self.f:
            return None
        with self._reading(S.VOCAB):
            g = self.f[S.VOCAB]
            raw, off = g["bytes"][()].tobytes(), g["offsets"][()].tolist()
        return [raw[off[i]: off[i + 1]].decode("utf-8", "replace") for i in range(len(off) - 1)]

    @cached_property
    def codes(self) -> dict[str, tuple[str, ...]]:
        """Code tables as stored: {"table/field": names}; a code is an index into names."""
        out = {}
        for t in S.TABLES:
            attrs = self.f[t.path].attrs
            for c in t.columns:
                if c.codes is not None:
                    names = attrs.get(f"codes:{c.name}")
                    out[f"{t.path}/{c.name}"] = tuple(str(x) for x in names) if names is not None else c.codes
        return out

    # -- tables --------------------------------------------------------------------------
    def _table(self, name: str) -> dict[str, np.ndarray]:
        """Committed records of one table as {field: contiguous array} (cached)."""
        cache = self.__dict__.setdefault("_tables", {})
        if name not in cache:
            with self._lock:  # UIs read from worker threads
                if name not in cache:
                    with self._reading(name):
                        d = self.f[name]
                        if self.f.swmr_mode:  # a live writer may have appended
                            d.id.refresh()
                        records = d[: min(self._status.get(name, 0), d.shape[0])]
                    fields = [k for k in S.TABLE[name].names if k in records.dtype.names]
                    cache[name] = {k: np.ascontiguousarray(records[k]) for k in fields}
        return cache[name]

    @property
    def steps(self) -> dict[str, np.ndarray]:
        """Columns index, model (code: MODELS), duration (s), rows, slice_offset, slice_count."""
        return self._table("steps")

    @property
    def num_steps(self) -> int:
        return len(self.steps["index"])

    @cached_property
    def _step_rows(self) -> tuple[np.ndarray, np.ndarray]:
        idx = self.steps["index"]
        order = np.argsort(idx, kind="stable")
        return idx[order], order

    def _step_row(self, index: int) -> int:
        srt, order = self._step_rows
        i = int(np.searchsorted(srt, index))
        if i >= len(srt) or srt[i] != index:
            raise KeyError(f"no step {index} in {self.path}")
        return int(order[i])

    def tokens(self, request_id: str) -> TokenRecords:
        """Tokens committed to one request, sorted by position, with their top-k."""
        t = self._table("tokens")
        sel = np.flatnonzero(t["request"] == self.request_index(request_id))
        sel = sel[np.argsort(t["position"][sel], kind="stable")]
        return TokenRecords(t["position"][sel], t["token"][sel], t["step"][sel], t["spec"][sel],
                            t["topk_ids"][sel], t["topk_logits"][sel])

    def step_plan(self, index: int) -> StepPlan:
        """The StepPlan of step `index`, exactly as the engine ran it."""
        i = self._step_row(index)
        st = self.steps
        lo, n = int(st["slice_offset"][i]), int(st["slice_count"][i])
        model = self.codes["steps/model"][int(st["model"][i])]
        return StepPlan(int(index), model, tuple(self._slice(j) for j in range(lo, lo + n)))

    def _slice(self, j: int) -> SeqSlice:
        sl = self._table("slices")
        toks = self._table("slice_tokens")["token"]
        lrows = self._table("slice_logit_rows")["row"]
        to, c = int(sl["token_offset"][j]), int(sl["count"][j])
        lo, lc = int(sl["logit_offset"][j]), int(sl["logit_count"][j])
        return SeqSlice(self.requests[int(sl["request"][j])].id, self.codes["slices/phase"][int(sl["phase"][j])],
                        int(sl["start"][j]), c, int(sl["row_offset"][j]), tuple(toks[to: to + c].tolist()),
                        tuple(lrows[lo: lo + lc].tolist()))

    def iter_plans(self) -> Iterator[StepPlan]:
        """Every step's plan, in execution order."""
        for idx in self.steps["index"].tolist():
            yield self.step_plan(idx)

    def kernels(self, step: int | None = None) -> dict[str, np.ndarray]:
        """Kernel choices (all, or of one step): step, layer, rows, m, n, k, splits as
        numbers; model, op, kernel as names (object arrays)."""
        t = self._table("kernels")
        if step is not None:
            srt, order = self._kernel_order
            lo, hi = np.searchsorted(srt, step, "left"), np.searchsorted(srt, step, "right")
            sel = np.sort(order[lo:hi])
            t = {k: v[sel] for k, v in t.items()}
        out = dict(t)
        for col in ("model", "op", "kernel"):
            out[col] = np.array(self.codes[f"kernels/{col}"], dtype=object)[t[col]]
        return out

    @cached_property
    def _kernel_order(self) -> tuple[np.ndarray, np.ndarray]:
        step = self._table("kernels")["step"]
        order = np.argsort(step, kind="stable")
        return step[order], order

    def kv_writes(self) -> dict[str, np.ndarray]:
        """KV writes: step, model (code), request (row in requests), layer, start, count, hash_offset."""
        return self._table("kv/writes")

    def kv_hashes(self) -> dict[str, np.ndarray]:
        """Per-position hashes: k_hash, v_hash (uint64); write i owns rows
        hash_offset[i] : hash_offset[i] + count[i]."""
        return self._table("kv/hashes")

    def live_kv(self, request_id: str, *, model: str = "target", at_step: int | None = None) -> dict[str, np.ndarray]:
        """For every (layer, position) of a request, the write live at `at_step` (the
        latest with step <= at_step; a later write replaces a rolled-back position;
        writes of one step: the later record). Arrays layer, position, step, k_hash,
        v_hash, sorted by (layer, position). Positions rolled back and not rewritten
        still show their last write."""
        w = self.kv_writes()
        sel = (w["request"] == self.request_index(request_id)) & (w["model"] == self.codes["kv/writes/model"].index(model))
        if at_step is not None:
            sel &= w["step"] <= at_step
        idx = np.flatnonzero(sel)
        count = w["count"][idx].astype(np.int64)
        total = int(count.sum())
        if total == 0:
            return {"layer": np.zeros(0, np.int16), "position": np.zeros(0, np.int32), "step": np.zeros(0, np.int64),
                    "k_hash": np.zeros(0, np.uint64), "v_hash": np.zeros(0, np.uint64)}
        rep = np.repeat(np.arange(idx.size), count)  # expand writes to positions
        within = np.arange(total) - np.repeat(np.cumsum(count) - count, count)
        wi = idx[rep]
        layer = w["layer"][wi]
        position = w["start"][wi].astype(np.int64) + within
        step = w["step"][wi]
        key = layer.astype(np.int64) * (int(position.max()) + 1) + position
        srt = np.lexsort((step, key))  # stable: equal (key, step) keep record order
        key_s = key[srt]
        pick = srt[np.flatnonzero(np.r_[key_s[1:] != key_s[:-1], True])]  # last per (layer, position)
        hrow = w["hash_offset"][wi[pick]] + within[pick]
        h = self.kv_hashes()
        return {"layer": layer[pick], "position": position[pick].astype(np.int32), "step": step[pick],
                "k_hash": h["k_hash"][hrow], "v_hash": h["v_hash"][hrow]}


# -- opening helpers -------------------------------------------------------------------
def _short(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _open_h5(p: Path) -> h5py.File:
    """Read-only; a file still open for writing (a live or killed SWMR run) is opened as a SWMR reader."""
    try:
        return h5py.File(p, "r")
    except OSError as e:
        msg = str(e)
        if "already open for write" not in msg and "lock" not in msg:
            raise TraceError(f"cannot read {p}: corrupt HDF5 ({_short(e)})") from None
    try:
        return _open_swmr(p)
    except Exception as e:
        raise TraceError(f"cannot read {p}: damaged trace of an unfinished run ({_short(e)})") from None


def _open_swmr(p: Path) -> h5py.File:
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_fclose_degree(h5py.h5f.CLOSE_STRONG)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_LATEST, h5py.h5f.LIBVER_LATEST)
    _limit_read_attempts(fapl)
    try:
        fid = h5py.h5f.open(os.fsencode(p), h5py.h5f.ACC_RDONLY | h5py.h5f.ACC_SWMR_READ, fapl=fapl)
    except OSError:  # the file lock is held and the filesystem insists: read without locking
        return h5py.File(p, "r", swmr=True, locking=False)
    return h5py.File(fid)


_H5PSET_ATTEMPTS = None


def _limit_read_attempts(fapl) -> None:
    """H5Pset_metadata_read_attempts is not in h5py: call it in the HDF5 library h5py
    loaded, if it can be found (else SWMR keeps its default of 100)."""
    global _H5PSET_ATTEMPTS
    if _H5PSET_ATTEMPTS is None:
        _H5PSET_ATTEMPTS = False
        libs = glob.glob(os.path.join(os.path.dirname(h5py.__file__) + ".libs", "libhdf5-*.so*"))
        libs += glob.glob(os.path.join(os.path.dirname(h5py.__file__), ".dylibs", "libhdf5*.dylib"))
        try:
            lib = ctypes.CDLL(libs[0]) if libs else ctypes.CDLL(None)
            fn = lib.H5Pset_metadata_read_attempts
            fn.argtypes, fn.restype = [ctypes.c_int64, ctypes.c_uint], ctypes.c_int
            _H5PSET_ATTEMPTS = fn
        except (OSError, AttributeError, IndexError):
            pass
    if _H5PSET_ATTEMPTS:
        _H5PSET_ATTEMPTS(fapl.id, SWMR_READ_ATTEMPTS)


def _check(p: Path, f: h5py.File) -> None:
    fmt = f.attrs.get("format")
    if isinstance(fmt, bytes):
        fmt = fmt.decode()
    if fmt != S.FORMAT:
        raise TraceError(f"{p} is an HDF5 file but not a divergence trace")
    try:
        version = int(f.attrs["schema_version"])
    except (KeyError, TypeError, ValueError):
        raise TraceError(f"{p} is a damaged trace: no valid schema_version") from None
    if version > S.SCHEMA_VERSION:
        raise TraceError(f"{p} uses trace schema {version}, newer than this divergence reads "
                         f"({S.SCHEMA_VERSION}): upgrade divergence")
    if version < 1:
        raise TraceError(f"{p} has an invalid schema_version {version}")
    missing = [n for n in (S.STATUS, S.META, S.REQUESTS) + tuple(t.path for t in S.TABLES) if n not in f]
    if missing:
        raise TraceError(f"{p} is a damaged trace: /{missing[0]} is missing")
    read_status(f)
