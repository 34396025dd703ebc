"""Streams engine events into an HDF5 trace (h5py, SWMR).

Every dataset is created at run start (chunked, resizable, compressed), then
the file switches to SWMR mode; events are buffered in memory and appended in
batches, flushed at least every FLUSH_SECONDS, so a run killed with SIGKILL
leaves a readable file holding every flushed step, marked incomplete. Each
batch writes the steps table last: a reader trusts only records of steps it
can see there.
"""
from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path

import h5py
import numpy as np

from ..core.events import AllReduce, KernelChoice, KvWrite, Observer, RequestEvent, Routing, RunInfo, StepEvent, TokenEvent
from . import schema as S

FLUSH_SECONDS = 0.5
FLUSH_STEPS = 256


def _json(obj) -> str:
    return json.dumps(obj, default=str, sort_keys=True)


class _Columns:
    """Buffered appends to one table (a group of equal-length 1-D datasets)."""

    def __init__(self, group: h5py.Group, spec: dict):
        self.ds = {}
        for name, (dtype, desc) in spec.items():
            d = group.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype, chunks=(S.CHUNK,),
                                     compression=S.COMPRESSION)
            d.attrs["description"] = desc
            self.ds[name] = d
        self.buf: dict[str, list] = {n: [] for n in spec}
        self.n = 0

    def add(self, **cols) -> None:
        for k, v in cols.items():
            self.buf[k].append(v)

    def extend(self, name: str, values) -> None:
        self.buf[name].extend(values)

    def pending(self) -> int:
        return len(next(iter(self.buf.values())))

    def write(self) -> None:
        k = self.pending()
        if not k:
            return
        for name, d in self.ds.items():
            d.resize((self.n + k,))
            d[self.n :] = np.asarray(self.buf[name], dtype=d.dtype)
            self.buf[name] = []
        self.n += k


class TraceWriter(Observer):
    """Observer that writes one run to `path`. Use as a context manager."""

    wants_kernels = True
    wants_topk = True
    wants_routing = True

    def __init__(self, path, *, top_k: int = 8, kv_hashes: bool = True, kv_hash: str = S.HASH_NAME,
                 ops=(), kernels=()):
        """kv_hash: the name of the 64-bit hash in /kv (another engine may use its own);
        ops / kernels: names beyond the core tables (another engine's own op and kernel
        labels), appended to the file's code tables: readers decode with the file's tables."""
        self.path = Path(path)
        self.top_k = top_k
        self.wants_kv_hashes = kv_hashes
        self.kv_hash = kv_hash
        self.ops = list(S.OPS) + [o for o in dict.fromkeys(ops) if o not in S.OPS]
        self.kernels = list(S.KERNELS) + [k for k in dict.fromkeys(kernels) if k not in S.KERNELS]
        self._op_code = {o: i for i, o in enumerate(self.ops)}
        self._kernel_code = {k: i for i, k in enumerate(self.kernels)}
        self.f: h5py.File | None = None
        self.tables: dict[str, _Columns] = {}
        self._req_index: dict[str, int] = {}
        self._last_flush = 0.0
        self._steps_since_flush = 0

    # -- context manager: a crash inside still leaves a file marked incomplete --
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close(completed=None)
        return False

    def on_run_start(self, info: RunInfo) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = self.f = h5py.File(self.path, "w", libver="latest")
        f.attrs["format"] = S.FORMAT
        f.attrs["schema_version"] = S.SCHEMA_VERSION
        f.attrs["created"] = datetime.now(timezone.utc).isoformat()
        f.attrs["schedule"] = info.schedule
        f.attrs["policy"] = info.policy
        f.attrs["top_k"] = self.top_k
        f.attrs["kv_hashes"] = bool(self.wants_kv_hashes)
        f.attrs["kv_hash"] = self.kv_hash
        f.attrs["models"] = list(S.MODELS)
        f.attrs["phases"] = list(S.PHASES)
        f.attrs["kernels"] = self.kernels
        f.attrs["ops"] = self.ops
        f.attrs["kinds"] = list(S.REQUEST_EVENTS)
        f.attrs["tp_backends"] = list(S.TP_BACKENDS)
        meta = f.create_group(S.META)
        meta.attrs["settings"] = _json(info.settings)
        meta.attrs["model"] = _json(info.model)
        meta.attrs["draft"] = _json(info.draft)
        meta.attrs["environment"] = _json(info.environment)
        status = f.create_dataset(S.STATUS, data=np.zeros(1, np.int8))
        status.attrs["description"] = "1 when the run completed; 0 while running or if it was killed"
        self._write_requests(f, info.requests)
        if info.vocab:
            # bytes + offsets, not vlen strings: token text may hold NUL characters
            pieces = [p.encode("utf-8", "surrogatepass") for p in info.vocab]
            g = f.create_group(S.VOCAB)
            g.attrs["description"] = "token i's text (decoded alone) is bytes[offsets[i]:offsets[i+1]], utf-8"
            g.create_dataset("bytes", data=np.frombuffer(b"".join(pieces), np.uint8))
            g.create_dataset("offsets", data=np.concatenate([[0], np.cumsum([len(p) for p in pieces])]))
        self.tables = {name: _Columns(f.require_group(name), spec) for name, spec in S.TABLES.items()}
        for path, dtype in ((S.TOPK_IDS, np.int32), (S.TOPK_LOGITS, np.float32)):
            d = f.create_dataset(path, shape=(0, self.top_k), maxshape=(None, self.top_k), dtype=dtype,
                                 chunks=(S.CHUNK // 4, self.top_k), compression=S.COMPRESSION)
            d.attrs["description"] = ("top-k token ids, best first" if dtype == np.int32
                                      else "top-k logits as float32, exactly as the model produced them")
        self._topk_ids: list = []
        self._topk_logits: list = []
        self._n_tokens = 0
        self._slice_rows = 0
        self._token_offset = 0
        self._logit_offset = 0
        self._hash_rows = 0
        self._choice_rows = 0
        f.swmr_mode = True
        f.flush()
        self._last_flush = time.perf_counter()

    def _write_requests(self, f: h5py.File, requests) -> None:
        g = f.create_group(S.REQUESTS)
        ids = [r.id for r in requests]
        self._req_index = {rid: i for i, rid in enumerate(ids)}
        lens = [len(r.prompt_tokens) for r in requests]
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        flat = np.concatenate([np.asarray(r.prompt_tokens, np.int32) for r in requests]) if requests else []
        cols = {
            "id": (np.array(ids, dtype=h5py.string_dtype()), "request id"),
            "prompt_offsets": (offsets, "request i's prompt is prompt_tokens[offsets[i]:offsets[i+1]]"),
            "prompt_tokens": (np.asarray(flat, np.int32), "prompt token ids, concatenated"),
            "arrival": (np.array([r.arrival for r in requests], np.int32), "target step at which it may start"),
            "max_tokens": (np.array([r.max_tokens for r in requests], np.int32), "tokens to generate at most"),
            "temperature": (np.array([r.sampling.temperature for r in requests], np.float64), "0 = greedy"),
            "top_p": (np.array([r.sampling.top_p for r in requests], np.float64), "nucleus sampling mass"),
            "seed": (np.array([r.sampling.seed for r in requests], np.int64), "sampling seed"),
        }
        for name, (data, desc) in cols.items():
            d = g.create_dataset(name, data=data)
            d.attrs["description"] = desc

    def _rid(self, request_id: str) -> int:
        return self._req_index[request_id]

    # -- events ----------------------------------------------------------------------
    def on_kernel(self, c: KernelChoice) -> None:
        self.tables["kernels"].add(step=c.step, model=S.MODELS.index(c.model), layer=c.layer, op=self._op_code[c.op],
                                   rows=c.rows, kernel=self._kernel_code[c.kernel], m=c.m, n=c.n, k=c.k,
                                   splits=c.splits, native_class=c.native_class, expert=c.expert)

    def on_allreduce(self, e: AllReduce) -> None:
        self.tables["allreduce"].add(step=e.step, model=S.MODELS.index(e.model), layer=e.layer, op=S.OPS.index(e.op),
                                     ranks=e.ranks, bytes=e.bytes, backend=S.TP_BACKENDS.index(e.backend))

    def on_kv_write(self, w: KvWrite) -> None:
        self.tables["kv/writes"].add(step=w.step, model=S.MODELS.index(w.model), request=self._rid(w.request_id),
                                     layer=w.layer, start=w.start, count=w.count, hash_offset=self._hash_rows)
        h = self.tables["kv/hashes"]
        h.extend("k_hash", w.k_hashes.tolist())
        h.extend("v_hash", w.v_hashes.tolist())
        self._hash_rows += w.count

    def on_routing(self, r: Routing) -> None:
        t, ch = self.tables["routing"], self.tables["routing/choices"]
        k = r.experts.shape[1]
        t.extend("step", [r.step] * r.count)
        t.extend("model", [S.MODELS.index(r.model)] * r.count)
        t.extend("request", [self._rid(r.request_id)] * r.count)
        t.extend("layer", [r.layer] * r.count)
        t.extend("position", range(r.start, r.start + r.count))
        t.extend("choice_offset", range(self._choice_rows, self._choice_rows + k * r.count, k))
        t.extend("k", [k] * r.count)
        t.extend("runner_up", r.runner_up.tolist())
        t.extend("runner_up_score", r.runner_up_score.tolist())
        t.extend("input_hash", r.input_hash.tolist())
        ch.extend("expert", r.experts.reshape(-1).tolist())
        ch.extend("score", r.scores.reshape(-1).tolist())
        self._choice_rows += k * r.count

    def on_token(self, e: TokenEvent) -> None:
        self.tables["tokens"].add(step=e.step, request=self._rid(e.request_id), position=e.position, token=e.token,
                                  spec=e.spec)
        ids = np.full(self.top_k, -1, np.int32)
        vals = np.full(self.top_k, np.nan, np.float32)
        n = min(self.top_k, len(e.topk_ids))
        ids[:n], vals[:n] = e.topk_ids[:n], e.topk_logits[:n]
        self._topk_ids.append(ids)
        self._topk_logits.append(vals)

    def on_request(self, e: RequestEvent) -> None:
        if e.request_id in self._req_index:
            self.tables["request_events"].add(step=e.step, request=self._rid(e.request_id),
                                              kind=S.REQUEST_EVENTS.index(e.kind))

    def on_step(self, e: StepEvent) -> None:
        plan = e.plan
        sl = self.tables["slices"]
        toks, lrows = self.tables["slices/input_tokens"], self.tables["slices/logit_rows"]
        for s in plan.slices:
            sl.add(step=plan.index, request=self._rid(s.request_id), phase=S.PHASES.index(s.phase), start=s.start,
                   count=s.count, row_offset=s.row_offset, token_offset=self._token_offset,
                   logit_offset=self._logit_offset, logit_count=len(s.logit_rows))
            toks.extend("value", s.tokens)
            lrows.extend("value", s.logit_rows)
            self._token_offset += len(s.tokens)
            self._logit_offset += len(s.logit_rows)
        self.tables["steps"].add(index=plan.index, model=S.MODELS.index(plan.model), duration=e.duration_s,
                                 rows=plan.rows, slice_offset=self._slice_rows, slice_count=len(plan.slices))
        self._slice_rows += len(plan.slices)
        self._steps_since_flush += 1
        now = time.perf_counter()
        if now - self._last_flush >= FLUSH_SECONDS or self._steps_since_flush >= FLUSH_STEPS:
            self.flush()

    def flush(self) -> None:
        if self.f is None:
            return
        for name, t in self.tables.items():
            if name != "steps":
                t.write()
        if self._topk_ids:
            for path, rows in ((S.TOPK_IDS, self._topk_ids), (S.TOPK_LOGITS, self._topk_logits)):
                d = self.f[path]
                d.resize((self._n_tokens + len(rows), self.top_k))
                d[self._n_tokens :] = np.stack(rows)
            self._n_tokens += len(self._topk_ids)
            self._topk_ids, self._topk_logits = [], []
        self.tables["steps"].write()  # last: a step is visible only once its records are
        self.f.flush()
        self._last_flush = time.perf_counter()
        self._steps_since_flush = 0

    def on_run_end(self, completed: bool) -> None:
        self.close(completed=completed)

    def close(self, *, completed: bool | None) -> None:
        if self.f is None:
            return
        try:
            self.flush()
            if completed:
                self.f[S.STATUS][0] = 1
                self.f.flush()
        finally:
            self.f.close()
            self.f = None
