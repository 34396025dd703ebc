"""Reading traces: lazy, numpy out, robust to files of killed runs.

    with Trace.open("traces/serial.h5") as t:
        t.tokens("r1").topk_logits      # float32 [n, K], exact
        t.step_plan(7)                  # the StepPlan replay re-executes
        t.live_kv("r1", at_step=40)     # which write each (layer, position) read at step 40
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import NamedTuple

import h5py
import numpy as np

from ..core.events import SeqSlice, StepPlan
from ..core.request import Sampling
from ..errors import TraceError
from . import schema as S


@dataclass(frozen=True)
class TraceRequest:
    id: str
    prompt_tokens: tuple
    arrival: int
    max_tokens: int
    sampling: Sampling


class TokenRecords(NamedTuple):
    positions: np.ndarray
    tokens: np.ndarray
    steps: np.ndarray
    spec: np.ndarray
    topk_ids: np.ndarray
    topk_logits: np.ndarray


class Trace:
    def __init__(self, path: Path, f: h5py.File):
        self.path = path
        self.f = f

    # -- opening ---------------------------------------------------------------------
    @classmethod
    def open(cls, path) -> "Trace":
        p = Path(path)
        if not p.exists():
            raise TraceError(f"no such trace: {p}")
        if p.is_dir():
            raise TraceError(f"{p} is a directory, not a trace file")
        try:
            if not h5py.is_hdf5(p):
                raise TraceError(f"{p} is not an HDF5 file (corrupt or not a trace)")
            try:
                f = h5py.File(p, "r")
            except OSError as e:
                if "truncated" in str(e):  # SWMR reads skip the EOF check and can hang on these
                    raise TraceError(f"{p} is truncated (corrupt or partially copied)") from None
                # a writer killed mid-run leaves the file marked open for SWMR writing
                f = h5py.File(p, "r", swmr=True)
        except TraceError:
            raise
        except (OSError, ValueError) as e:
            raise TraceError(f"cannot read {p}: corrupt HDF5 ({e})") from None
        try:
            fmt = f.attrs.get("format")
            if fmt != S.FORMAT:
                raise TraceError(f"{p} is an HDF5 file but not a divergence trace")
            version = int(f.attrs.get("schema_version", -1))
            if version > S.SCHEMA_VERSION:
                raise TraceError(f"{p} uses trace schema {version}, newer than this divergence reads "
                                 f"({S.SCHEMA_VERSION}); upgrade divergence")
            if version < 1:
                raise TraceError(f"{p} has no valid schema_version")
            for name in ("steps", "tokens", S.REQUESTS, S.META):
                if name not in f:
                    raise TraceError(f"{p} is a damaged trace: /{name} is missing")
        except TraceError:
            f.close()
            raise
        except Exception as e:  # damaged metadata
            f.close()
            raise TraceError(f"cannot read {p}: {e}") from None
        return cls(p, f)

    def close(self) -> None:
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    # -- metadata ----------------------------------------------------------------------
    @property
    def schema_version(self) -> int:
        return int(self.f.attrs["schema_version"])

    @property
    def completed(self) -> bool:
        return bool(self.f[S.STATUS][0])

    @property
    def has_kv_hashes(self) -> bool:
        return bool(self.f.attrs.get("kv_hashes", False))

    @cached_property
    def meta(self) -> dict:
        m = self.f[S.META].attrs
        out = {k: json.loads(m[k]) for k in ("settings", "model", "draft", "environment")}
        for k in ("schedule", "policy", "created", "top_k"):
            v = self.f.attrs.get(k)
            out[k] = v.item() if hasattr(v, "item") else v
        out["completed"] = self.completed
        return out

    @cached_property
    def requests(self) -> list[TraceRequest]:
        g = self.f[S.REQUESTS]
        ids = [x.decode() if isinstance(x, bytes) else str(x) for x in g["id"][()]]
        off = g["prompt_offsets"][()]
        flat = g["prompt_tokens"][()]
        arr, mt = g["arrival"][()], g["max_tokens"][()]
        temp, top_p, seed = g["temperature"][()], g["top_p"][()], g["seed"][()]
        return [TraceRequest(rid, tuple(int(t) for t in flat[off[i]: off[i + 1]]), int(arr[i]), int(mt[i]),
                             Sampling(float(temp[i]), float(top_p[i]), int(seed[i]))) for i, rid in enumerate(ids)]

    def request_index(self, request_id: str) -> int:
        for i, r in enumerate(self.requests):
            if r.id == request_id:
                return i
        raise KeyError(f"no request {request_id!r} in {self.path}")

    @cached_property
    def vocab(self) -> list[str] | None:
        if S.VOCAB not in self.f:
            return None
        g = self.f[S.VOCAB]
        raw, off = g["bytes"][()].tobytes(), g["offsets"][()]
        return [raw[off[i]: off[i + 1]].decode("utf-8", "replace") for i in range(len(off) - 1)]

    # -- tables --------------------------------------------------------------------------
    def _table(self, name: str) -> dict[str, np.ndarray]:
        g = self.f[name]
        cols = {k: g[k] for k in S.TABLES[name] if k in g}  # older schemas lack newer columns
        for d in cols.values():
            d.id.refresh()  # a live (SWMR) writer may have appended
        n = min(d.shape[0] for d in cols.values())  # a killed writer may leave a ragged end
        out = {k: d[:n] for k, d in cols.items()}
        for k, (dtype, _) in S.TABLES[name].items():
            if k not in out:
                out[k] = np.full(n, S.DEFAULTS.get((name, k), 0), dtype)
        return out

    @cached_property
    def steps(self) -> dict[str, np.ndarray]:
        return self._table("steps")

    @property
    def num_steps(self) -> int:
        return len(self.steps["index"])

    @cached_property
    def _last_step(self) -> int:
        return int(self.steps["index"].max()) if self.num_steps else -1

    def _visible(self, name: str) -> dict[str, np.ndarray]:
        """Records of steps the steps table holds (a killed batch may have left more)."""
        t = self._table(name)
        keep = t["step"] <= self._last_step
        return t if keep.all() else {k: v[keep] for k, v in t.items()}

    @cached_property
    def _tokens(self) -> dict[str, np.ndarray]:
        t = self._table("tokens")
        ids, logits = self.f[S.TOPK_IDS], self.f[S.TOPK_LOGITS]
        n = min(len(t["step"]), ids.shape[0], logits.shape[0])
        t = {k: v[:n] for k, v in t.items()}
        t["topk_ids"], t["topk_logits"] = ids[:n], logits[:n]
        keep = t["step"] <= self._last_step
        return t if keep.all() else {k: v[keep] for k, v in t.items()}

    def tokens(self, request_id: str) -> TokenRecords:
        t = self._tokens
        sel = np.flatnonzero(t["request"] == self.request_index(request_id))
        sel = sel[np.argsort(t["position"][sel], kind="stable")]
        return TokenRecords(t["position"][sel], t["token"][sel], t["step"][sel], t["spec"][sel],
                            t["topk_ids"][sel], t["topk_logits"][sel])

    @cached_property
    def _slices(self) -> dict[str, np.ndarray]:
        t = self._visible("slices")
        t["input_tokens"] = self._table("slices/input_tokens")["value"]
        t["logit_rows"] = self._table("slices/logit_rows")["value"]
        return t

    def step_plan(self, index: int) -> StepPlan:
        st = self.steps
        i = np.flatnonzero(st["index"] == index)
        if not i.size:
            raise KeyError(f"no step {index} in {self.path}")
        i = int(i[0])
        sl = self._slices
        lo, n = int(st["slice_offset"][i]), int(st["slice_count"][i])
        return StepPlan(int(index), S.MODELS[int(st["model"][i])], tuple(self._slice(sl, j) for j in range(lo, lo + n)))

    def _slice(self, sl, j: int) -> SeqSlice:
        to, c = int(sl["token_offset"][j]), int(sl["count"][j])
        lo, lc = int(sl["logit_offset"][j]), int(sl["logit_count"][j])
        return SeqSlice(self.requests[int(sl["request"][j])].id, S.PHASES[int(sl["phase"][j])], int(sl["start"][j]),
                        c, int(sl["row_offset"][j]), tuple(int(x) for x in sl["input_tokens"][to: to + c]),
                        tuple(int(x) for x in sl["logit_rows"][lo: lo + lc]))

    def iter_plans(self):
        for idx in self.steps["index"]:
            yield self.step_plan(int(idx))

    def kernels(self, step: int | None = None) -> dict[str, np.ndarray]:
        """Kernel choices (all, or of one step), with op / kernel / model as names."""
        t = self._all_kernels
        if step is not None:
            sel = t["step"] == step
            t = {k: v[sel] for k, v in t.items()}
        out = dict(t)
        out["op"] = self._names("ops", S.OPS)[t["op"]]
        out["kernel"] = self._names("kernels", S.KERNELS)[t["kernel"]]
        out["model"] = np.array(S.MODELS)[t["model"]]
        return out

    def _names(self, attr: str, default: tuple) -> np.ndarray:
        """A code table as the file stores it (traces of other engines extend the core's)."""
        v = self.f.attrs.get(attr)
        return np.array([x.decode() if isinstance(x, bytes) else str(x) for x in v] if v is not None else default)

    @property
    def kv_hash(self) -> str:
        """Name of the 64-bit hash in /kv (xxh3_64 for this engine's traces)."""
        v = self.f.attrs.get("kv_hash", S.HASH_NAME)
        return v.decode() if isinstance(v, bytes) else str(v)

    @cached_property
    def _all_kernels(self) -> dict[str, np.ndarray]:
        return self._visible("kernels")

    def allreduces(self, step: int | None = None) -> dict[str, np.ndarray]:
        """Tensor-parallel all-reduce records (all, or of one step), op / model / backend
        as names; empty for traces of one device (or written before the table existed)."""
        if "allreduce" in self.f:
            t = self._visible("allreduce")
        else:
            t = {k: np.zeros(0, dt) for k, (dt, _) in S.TABLES["allreduce"].items()}
        if step is not None:
            sel = t["step"] == step
            t = {k: v[sel] for k, v in t.items()}
        out = dict(t)
        out["op"] = self._names("ops", S.OPS)[t["op"]]
        out["model"] = np.array(S.MODELS)[t["model"]]
        out["backend"] = self._names("tp_backends", S.TP_BACKENDS)[t["backend"]]
        return out

    @property
    def tp_degree(self) -> int:
        """Tensor-parallel degree the trace was recorded at (1: one device)."""
        return int((self.meta.get("settings", {}).get("tp") or {}).get("degree", 1))

    def kv_writes(self) -> dict[str, np.ndarray]:
        return self._kv_writes

    @cached_property
    def _kv_writes(self) -> dict[str, np.ndarray]:
        return self._visible("kv/writes")

    def kv_hashes(self) -> dict[str, np.ndarray]:
        return self._table("kv/hashes")

    @cached_property
    def _hashes(self):
        return self.kv_hashes()

    def live_kv(self, request_id: str, *, model: str = "target", at_step: int | None = None) -> dict[str, np.ndarray]:
        """For every (layer, position) of a request, the write live at `at_step` (the
        latest with step <= at_step: later writes overwrite rolled-back positions).
        Arrays layer, position, step, k_hash, v_hash, sorted by (layer, position)."""
        w = self._kv_writes
        sel = (w["request"] == self.request_index(request_id)) & (w["model"] == S.MODELS.index(model))
        if at_step is not None:
            sel &= w["step"] <= at_step
        idx = np.flatnonzero(sel)
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
        h = self._hashes
        hrow_p = hrow[pick]
        return {"layer": layer[pick], "position": position[pick], "step": step[pick],
                "k_hash": h["k_hash"][hrow_p], "v_hash": h["v_hash"][hrow_p]}

    @property
    def has_routing(self) -> bool:
        """Whether the trace holds MoE routing (its model has expert layers)."""
        return "routing" in self.f and self.f["routing/step"].shape[0] > 0

    @cached_property
    def _routing(self) -> dict[str, np.ndarray]:
        if "routing" not in self.f:
            return {k: np.zeros(0, dt) for k, (dt, _) in S.TABLES["routing"].items()}
        return self._visible("routing")

    @cached_property
    def _routing_choices(self) -> dict[str, np.ndarray]:
        return self._table("routing/choices") if "routing" in self.f else {"expert": np.zeros(0, np.int16),
                                                                            "score": np.zeros(0, np.float32)}

    def routing(self, request_id: str, *, model: str = "target", at_step: int | None = None) -> dict[str, np.ndarray]:
        """A request's MoE routing, one row per (layer, position): the record live at
        `at_step` (the latest with step <= at_step; all steps when None), sorted by
        (position, layer). Arrays layer, position, step, runner_up, runner_up_score,
        input_hash [n], experts int [n, k], scores float32 [n, k]."""
        t = self._routing
        sel = (t["request"] == self.request_index(request_id)) & (t["model"] == S.MODELS.index(model))
        if at_step is not None:
            sel &= t["step"] <= at_step
        idx = np.flatnonzero(sel)
        key = t["position"][idx].astype(np.int64) * 65536 + t["layer"][idx]
        srt = np.lexsort((idx, t["step"][idx], key))  # latest write of a (position, layer) last
        ks = key[srt]
        pick = idx[srt[np.flatnonzero(np.r_[ks[1:] != ks[:-1], True])]] if idx.size else idx
        out = {c: t[c][pick] for c in ("layer", "position", "step", "runner_up", "runner_up_score", "input_hash")}
        k = int(t["k"][pick].max()) if pick.size else 0
        if pick.size and not (t["k"][pick] == k).all():
            raise ValueError("routing rows of one request hold different k")  # one model: one top-k
        ch = self._routing_choices
        rows = t["choice_offset"][pick][:, None] + np.arange(k)[None, :]
        out["experts"] = ch["expert"][rows].astype(np.int32)
        out["scores"] = ch["score"][rows]
        return out

    def finish_step(self, request_id: str) -> int | None:
        t = self._table("request_events")
        sel = (t["request"] == self.request_index(request_id)) & (t["kind"] == S.REQUEST_EVENTS.index("finished"))
        return int(t["step"][sel][0]) if sel.any() else None
