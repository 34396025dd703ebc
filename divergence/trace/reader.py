"""Reading traces: lazy, numpy out, robust to files of killed runs, schema 1 and 2.

    with Trace.open("traces/serial.h5") as t:
        t.tokens("r1").topk_logits      # float32 [n, K], exact
        t.step_plan(7)                  # the StepPlan replay re-executes
        t.live_kv("r1", at_step=40)     # which write each (layer, position) read at step 40
        t.table("draws")                # any table of schema.TABLES, as column arrays

A Trace is a snapshot: the commit record (schema 2; the steps table for schema 1)
is read first, each table once, cut to what that snapshot holds, so records read
from several threads, at different times, agree. `refresh()` starts a new snapshot
of a file that is still being written.
"""
from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np

from ..core.request import Sampling
from ..errors import DivergenceInputError, TraceError
from . import schema as S
from . import validate, validate_header
from .h5lock import H5_LOCK
from .header import TraceRequest, read_meta, read_requests, read_vocab
from .layout import read_commit, read_rows
from .layout_v1 import read_v1_table
from .opening import FILES as _FILES, check as _check
from .views import RecordViews


class Trace(RecordViews):
    def __init__(self, path: Path, f: h5py.File, *, swmr: bool = False):
        self.path = path
        self.f = f
        self.swmr = swmr  # opened as an SWMR reader: a live or killed run, whose datasets need refreshing
        self.version = int(f.attrs["schema_version"])
        self._cache: dict = {}
        self.selected: frozenset | None = None  # select(): the requests an analysis compares (None: all)
        self.rows_read: dict[str, int] = {}  # table -> records read so far (whole tables and ranges)

    # -- opening ---------------------------------------------------------------------
    @classmethod
    def open(cls, path) -> "Trace":
        p = Path(path)
        if not p.exists():
            raise TraceError(f"no such trace: {p}")
        if p.is_dir():
            raise TraceError(f"{p} is a directory, not a trace file")
        with H5_LOCK:
            f, swmr = _FILES.acquire(p)
            try:
                _check(p, f)
            except TraceError:
                _FILES.release(f)
                raise
            except Exception as e:  # damaged metadata
                _FILES.release(f)
                raise TraceError(f"cannot read {p}: {validate.one_line(e)}") from None
        return cls(p, f, swmr=swmr)

    def close(self) -> None:
        with H5_LOCK:
            if self.f is not None:
                _FILES.release(self.f)
                self.f = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def refresh(self) -> None:
        """Forget what was read: the next reads see what a live writer appended since."""
        with H5_LOCK:
            self._cache.clear()

    def _once(self, key, load):
        """load() once per snapshot, under the HDF5 lock (reads from several threads are safe)."""
        try:
            return self._cache[key]
        except KeyError:
            pass
        with H5_LOCK:
            if key not in self._cache:
                self._cache[key] = load()
            return self._cache[key]

    # -- metadata ----------------------------------------------------------------------
    @property
    def schema_version(self) -> int:
        return self.version

    @property
    def completed(self) -> bool:
        with H5_LOCK:
            return validate_header.status(self.path, self.f)

    @property
    def has_kv_hashes(self) -> bool:
        return bool(self._attrs.get("kv_hashes", False))

    @property
    def _attrs(self) -> dict:
        return self._once("attrs", self._read_attrs)

    def _read_attrs(self) -> dict:
        try:
            a = dict(self.f.attrs)
        except Exception as e:  # noqa: BLE001  (HDF5: a damaged attribute heap)
            raise validate.damaged(self.path, f"its attributes cannot be read ({e})") from None
        validate_header.attrs(self.path, a)
        return a

    def codes(self, key: str) -> tuple[str, ...]:
        """A code table as this file stored it (e.g. 'ops'); schema's own where the file has none."""
        v = self._attrs.get(key)
        if v is None:
            return tuple(S.CODE_TABLES[key])
        return tuple(x.decode() if isinstance(x, bytes) else str(x) for x in v)

    @property
    def kv_hash(self) -> str:
        """Name of the 64-bit hash in the KV tables (xxh3_64 for this engine's traces)."""
        v = self._attrs.get("kv_hash", S.HASH_NAME)
        return v.decode() if isinstance(v, bytes) else str(v)

    @property
    def tp_degree(self) -> int:
        """Tensor-parallel degree the trace was recorded at (1: one device)."""
        return int((self.meta.get("settings", {}).get("tp") or {}).get("degree", 1))

    @property
    def meta(self) -> dict:
        return self._once("meta", lambda: read_meta(self.f, self.path, self._attrs))

    @property
    def requests(self) -> list[TraceRequest]:
        return self._once("requests", self._requests)

    def _requests(self) -> list[TraceRequest]:
        out = read_requests(self.f, self.path)
        out += self._live_requests()
        validate_header.request_ids(self.path, [r.id for r in out])
        self._check_request_count(len(out))
        return out

    def _live_requests(self) -> list[TraceRequest]:
        """Requests that joined while the run ran (a live server's /live_requests), after /requests."""
        if self.version != 2:
            return []
        try:
            commit = self._once("commit", self._commit)
        except TraceError:
            raise
        except Exception as e:  # noqa: BLE001  (HDF5: OSError, KeyError of a damaged commit record)
            raise validate.damaged(self.path, f"its commit record cannot be read ({e})") from None
        if "live_requests" not in commit:
            return []
        t, flat = self._raw("live_requests"), self._raw("live_prompt_tokens")["value"]
        # a server's day holds 10^5 requests: their prompts' tuples share one int object per token id,
        # and requests one Sampling per setting (a token as its own int: 28 bytes more; 3x the memory)
        ints = list(range(int(flat.max()) + 1)) if len(flat) and int(flat.min()) >= 0 else None
        shared: dict = {}
        lo, n = t["prompt_offset"].tolist(), t["prompt_count"].tolist()
        out = []
        for i, rid in enumerate(t["id"].tolist()):
            ids = flat[lo[i]: lo[i] + n[i]].tolist()
            s = Sampling(float(t["temperature"][i]), float(t["top_p"][i]), int(t["seed"][i]))
            out.append(TraceRequest(bytes(rid).decode("ascii", "replace"),
                                    tuple(map(ints.__getitem__, ids)) if ints is not None else tuple(ids),
                                    int(t["arrival"][i]), int(t["max_tokens"][i]), shared.setdefault(s, s)))
        return out

    def _check_request_count(self, n: int) -> None:
        """Every request arrives (/request_events): one past /requests means the table was cut."""
        try:
            t = S.TABLES["request_events"]
            cols = read_v1_table(self.f, t, refresh=self.swmr) if self.version == 1 else self._read_v2("request_events")
        except TraceError:
            raise
        except Exception as e:  # noqa: BLE001
            raise validate.damaged(self.path, f"cannot read /request_events ({e})") from None
        req = cols.get("request")
        if req is not None and len(req) and req.dtype.kind in "iu" and int(req.max()) >= n:
            i = int(np.flatnonzero(req >= n)[0])
            raise validate.damaged(self.path, f"/request_events row {i} names request {int(req[i])}, but /requests "
                                              f"holds {n}")

    def select(self, request_ids) -> "Trace":
        """Restrict what diff, bisect and report compare to these requests (`--requests`), and
        read per request only their rows (trace/ranged.py). An id the trace lacks is a
        DivergenceInputError. Returns self."""
        ids = [str(i) for i in request_ids]
        if not ids:
            raise DivergenceInputError("--requests names no request")
        known = self._once("request_index", lambda: {r.id: i for i, r in enumerate(self.requests)})
        for rid in ids:
            if rid not in known:
                raise DivergenceInputError(f"--requests: no request {rid!r} in {self.path} ({len(known)} requests)")
        self.selected = frozenset(ids)
        return self

    def request_index(self, request_id: str) -> int:
        idx = self._once("request_index", lambda: {r.id: i for i, r in enumerate(self.requests)})
        try:
            return idx[request_id]
        except KeyError:
            raise KeyError(f"no request {request_id!r} in {self.path}") from None

    @property
    def vocab(self) -> list[str] | None:
        return self._once("vocab", lambda: read_vocab(self.f, self.path))

    # -- tables --------------------------------------------------------------------------
    def _widths(self) -> dict:
        try:
            w = json.loads(self._attrs.get("widths", "{}"))
        except (TypeError, ValueError):
            w = {}
        w.setdefault("top_k", int(self._attrs.get("top_k", S.DEFAULT_WIDTHS["top_k"])))
        return w

    def _raw(self, name: str) -> dict[str, np.ndarray]:
        """Every record of a table on disk (codes as stored), its schema columns complete."""
        t = S.TABLES[name]
        try:
            if self.version == 1:
                cols = read_v1_table(self.f, t, refresh=self.swmr)
            else:
                cols = self._read_v2(name)
        except TraceError:
            raise
        except Exception as e:  # noqa: BLE001  (HDF5: OSError, KeyError, TypeError of a foreign object)
            raise validate.damaged(self.path, f"cannot read /{name} ({e})") from None
        return self._columns(name, cols)

    def _columns(self, name: str, cols: dict[str, np.ndarray], *, partial: bool = False) -> dict[str, np.ndarray]:
        """Columns of a table as stored (every row; `partial`: some, trace/ranged.py) checked,
        its schema columns complete (each missing one its default)."""
        t = S.TABLES[name]
        widths = self._once("widths", self._widths)
        validate.table(self, name, cols, widths)
        n = len(next(iter(cols.values()))) if cols else 0
        self.rows_read[name] = self.rows_read.get(name, 0) + n
        out = {}
        for col, c in t.columns.items():
            out[col] = cols[col] if col in cols else S.default_array(c, n, S.column_width(c, widths))
        for col, src in t.derived.items():
            out[col] = cols[col] if col in cols else out[src].copy()
        validate.contents(self, name, out, partial=partial)
        return out

    def _rows(self, name: str) -> int:
        """Rows of a table in this snapshot (what offsets into it may reach), without reading it (schema 2)."""
        if self.version == 2:
            nb, nt, _ = self._once("commit", self._commit).get(name, (0, 0, 0))
            return nb + nt
        return self._once(("rows", name), lambda: len(next(iter(
            read_v1_table(self.f, S.TABLES[name], refresh=self.swmr).values()), ())))

    def check(self) -> "Trace":
        """Read and check every table now (they are checked when first read anyway): a damaged
        trace is one TraceError naming the table and row. Returns self."""
        with H5_LOCK:
            if self._cache.get("checked"):
                return self
            self._cache["checked"] = True  # (reading the tokens below comes back here)
            try:
                self._attrs, self.completed, self.requests, self.meta, self.vocab
                for name in S.TABLES:
                    self.table(name, raw=True)
            except BaseException:
                self._cache.pop("checked", None)
                raise
        return self

    def _read_v2(self, name: str) -> dict[str, np.ndarray]:
        commit = self._once("commit", self._commit)  # the snapshot
        if name not in commit:
            return {}
        nb, nt, _ = commit[name]
        if not isinstance(self.f.get(name), h5py.Dataset):
            raise validate.damaged(self.path, f"/{name} is not a dataset")
        validate.records(self.path, name, self.f[name])
        rec = read_rows(self.f, name, nb + nt, refresh=self.swmr) if S.COMMIT in self.f else self.f[name][: nb + nt]
        validate.records(self.path, name, rec)
        if S.COMMIT in self.f:
            validate.rows_committed(self.path, name, len(rec), nb + nt)
        return {k: np.ascontiguousarray(rec[k]) for k in rec.dtype.names}

    def _commit(self) -> dict:
        if S.COMMIT in self.f:
            names = validate_header.code_table(self.path, "commit_tables", self._attrs.get("commit_tables"), ())
            validate_header.commit(self.path, self.f[S.COMMIT], names)
            return read_commit(self.f, refresh=self.swmr)[1]
        # schema-2 files written without a commit record: whole datasets, steps written last
        sizes = {}
        for name in ("steps", *S.TABLES):
            if name in self.f and isinstance(self.f[name], h5py.Dataset):
                if self.swmr:
                    self.f[name].refresh()
                sizes[name] = (self.f[name].shape[0], 0, 0)
        return sizes

    @property
    def steps(self) -> dict[str, np.ndarray]:
        return self._once("steps", lambda: self._raw("steps"))

    @property
    def num_steps(self) -> int:
        return len(self.steps["index"])

    @property
    def _last_step(self) -> int:
        st = self.steps
        return int(st["index"].max()) if len(st["index"]) else -1

    def _visible(self, name: str) -> dict[str, np.ndarray]:
        """Records of steps the steps snapshot holds (a flush cut short may have left more)."""
        def load():
            last = self._last_step  # the steps snapshot first: every record of its steps is on disk by then
            t = self._raw(name)
            if not S.TABLES[name].by_step:
                return t
            keep = t["step"] <= last
            return t if keep.all() else {k: v[keep] for k, v in t.items()}
        t = self._once(("visible", name), load)
        if name == "tokens" and not self.ranged:  # every command reads the tokens: check the other tables then
            self.check()  # too (once); a large trace's readers check the rows they read (trace/ranged.py)
        return t

    def has_table(self, name: str) -> bool:
        """Whether the file holds the table at all (written before a table existed: no)."""
        t = S.TABLES.get(S.ALIASES.get(name, name))
        if t is None:
            return False
        path = (t.v1 if self.version == 1 else S.ALIASES.get(name, name))
        return self._once(("has", path), lambda: path is not None and path in self.f)

    def table(self, name: str, *, raw: bool = False) -> dict[str, np.ndarray]:
        """A table of schema.TABLES as column arrays (empty for a table this trace lacks), with
        code columns decoded to names unless `raw`; `request` stays an index into requests."""
        name = S.ALIASES.get(name, name)
        if name not in S.TABLES:
            raise KeyError(f"no trace table {name!r} (tables: {', '.join(S.TABLES)})")
        t = self.steps if name == "steps" else self._visible(name)
        return dict(t) if raw else self._decode(name, t)

    def _decode(self, name: str, t: dict) -> dict:
        out = dict(t)
        for col, c in S.TABLES[name].columns.items():
            if c.codes is not None and c.codes != S.REQUEST:
                out[col] = self._names(c.codes)[t[col]]
        return out

    def _names(self, key: str) -> np.ndarray:
        return self._once(("names", key), lambda: np.array(self.codes(key)))
