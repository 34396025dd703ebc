"""`Recorder`: how a Python engine (numpy, PyTorch, JAX: no MLX needed) writes a trace.

    from divergence.record import Recorder, hash_kv

    with Recorder("serial.h5", engine="toy 0.1", schedule="serial",
                  requests=[{"id": "r1", "prompt": [5, 9, 2]}]) as rec:
        rec.step([("r1", "prefill", 0, 3)])
        rec.kernel("q_proj", "mv", layer=0, rows=3)
        rec.kv_write("r1", layer=0, start=0, k_hashes=hash_kv(k), v_hashes=hash_kv(v))
        rec.token("r1", position=3, token=17, topk_ids=ids, topk_logits=logits)

Every call is checked against the contract (docs/recording.md) when it is made:
a bad record raises RecordError at the line that made it. The records are kept in
memory and written at exit through the trace writer as the engine's own events,
so every reader, diff, bisect and browse sees an ordinary trace (marked with
settings.engine: divergence's replay refuses it). An exception inside the block
still writes what was recorded, marked incomplete; a refused record (a RecordError
leaving the block) writes nothing.
"""
from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import numpy as np

from ..core.atomic import temp_name
from ..core.events import KernelChoice, KvWrite, RequestEvent, RunInfo, SeqSlice, StepEvent, StepPlan, TokenEvent
from ..core.hashing import HASH_NAME
from ..core.names import RECORD_KINDS
from ..core.request import Request, Sampling
from ..errors import PromptError, RecordError
from .contract import CONTRACT_VERSION, check


class Recorder:
    """Collects one run's records; `close()` (or the end of a `with` block) writes the trace."""

    def __init__(self, path=None, *, engine: str, schedule: str, requests=(), kv_hash: str | None = HASH_NAME,
                 top_k: int | None = None, policy: str = "native", model: dict | None = None,
                 settings: dict | None = None, environment: dict | None = None, vocab=None, observers=None):
        """kv_hash: the name of the 64-bit hash your kv_write hashes are (hash_kv gives xxh3_64).
        requests: dicts with the `request` record's fields, or divergence Requests; more can
        be added with `request()` before they are used.
        observers: instead of a path, send the checked records as engine events to these
        (divergence.core.events.Observer, e.g. a TraceWriter you made) at close."""
        if (path is None) == (observers is None):
            raise RecordError("Recorder: give a trace path or observers, not both")
        self.path = Path(path) if path is not None else None
        self.observers = list(observers) if observers is not None else None
        self.run = check("run", {"engine": engine, "schedule": schedule, "kv_hash": kv_hash, "top_k": top_k,
                                 "policy": policy, "model": model, "settings": settings,
                                 "environment": environment, "vocab": vocab})
        self._requests: dict[str, dict] = {}
        self._steps: list[dict] = []
        self._step_index: dict[int, dict] = {}
        self._records: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        self._generated: dict[str, list[int]] = {}  # request -> tokens, in position order
        self._finished: dict[str, int] = {}  # request -> the step of its finish
        self._closed = False
        for r in requests:
            self.add("request", _request_fields(r))

    # -- the records ---------------------------------------------------------------
    def request(self, id: str, prompt, **fields) -> None:
        """Declare a request (id, prompt token ids, max_tokens, arrival, temperature, top_p, seed)."""
        self.add("request", {"id": id, "prompt": prompt, **fields})

    def step(self, slices, *, index: int | None = None, model: str | None = None, duration: float = 0.0) -> int:
        """Open a step: its composition, one slice per sequence: (request, phase, start, count),
        a dict with those keys (+ row_offset, tokens), or a SeqSlice. Returns its index."""
        if index is None:
            index = self._steps[-1]["index"] + 1 if self._steps else 0
        return self.add("step", {"index": index, "slices": slices, "model": model, "duration": duration})

    def kernel(self, op: str, kernel: str, *, layer: int, rows: int, step: int | None = None,
               model: str | None = None, m: int | None = None, n: int = 0, k: int = 0) -> None:
        """Which kernel (as your engine names it) ran op at layer, over `rows` rows."""
        self.add("kernel", {"step": step, "layer": layer, "op": op, "rows": rows, "kernel": kernel,
                            "model": model, "m": m, "n": n, "k": k})

    def kv_write(self, request: str, *, layer: int, start: int, k_hashes, v_hashes, step: int | None = None,
                 model: str | None = None) -> None:
        """K/V rows written to the cache at positions start.. (one 64-bit hash per position)."""
        self.add("kv_write", {"step": step, "request": request, "layer": layer, "start": start,
                              "k_hashes": k_hashes, "v_hashes": v_hashes, "model": model})

    def token(self, request: str, *, position: int, token: int, topk_ids, topk_logits, logit=None,
              step: int | None = None, spec: int = 0) -> None:
        """A generated token: its position, id, the top-k ids and float32 logits (best first)."""
        self.add("token", {"step": step, "request": request, "position": position, "token": token,
                           "topk_ids": topk_ids, "topk_logits": topk_logits, "logit": logit, "spec": spec})

    def finish(self, request: str, *, reason: str = "", step: int | None = None) -> None:
        self.add("finish", {"step": step, "request": request, "reason": reason})

    def add(self, kind: str, fields: dict, *, json_hashes: bool = False):
        """Check one record (a dict of the contract's fields) and keep it: the typed methods
        above and `divergence import` both come through here."""
        if self._closed:
            raise RecordError("the recorder is closed")
        if kind not in RECORD_KINDS:
            raise RecordError(f"unknown record kind {kind!r} (kinds: {', '.join(RECORD_KINDS)})")
        if kind in ("kernel", "kv_write", "token", "finish") and fields.get("step") is None:
            if not self._steps:
                raise RecordError(f"{kind}: no step yet (call step() first)")
            fields = {**fields, "step": self._steps[-1]["index"]}
        r = check(kind, fields, json_hashes=json_hashes)
        return getattr(self, f"_add_{kind}")(r)

    def _add_request(self, r: dict) -> None:
        if r["id"] in self._requests:
            raise RecordError(f"request: id {r['id']!r} is declared twice")
        if not len(r["prompt"]):
            raise RecordError(f"request {r['id']!r}: the prompt is empty")
        self._requests[r["id"]] = r
        self._generated[r["id"]] = []

    def _known(self, kind: str, rid: str) -> dict:
        if rid not in self._requests:
            raise RecordError(f"{kind}: unknown request {rid!r} (declare it with a request record first)")
        return self._requests[rid]

    def _add_step(self, r: dict) -> int:
        if self._steps and r["index"] <= self._steps[-1]["index"]:
            raise RecordError(f"step: index {r['index']} does not follow step {self._steps[-1]['index']} "
                              f"(steps must be strictly increasing)")
        row, taken = 0, []
        for i, s in enumerate(r["slices"]):
            req = self._known("step", s["request"])
            if s["row_offset"] is None:
                s["row_offset"] = row
            row = s["row_offset"] + s["count"]
            taken.append((s["row_offset"], row, s["request"]))
            if s["tokens"] is not None and len(s["tokens"]) != s["count"]:
                raise RecordError(f"step.slices[{i}]: {len(s['tokens'])} tokens for {s['count']} rows")
            if s["phase"] == "prefill" and s["start"] + s["count"] > len(req["prompt"]):
                raise RecordError(f"step.slices[{i}]: prefill rows {s['start']}..{s['start'] + s['count'] - 1} "
                                  f"go past the prompt of {s['request']!r} ({len(req['prompt'])} tokens)")
        taken.sort()
        for (a0, a1, ra), (b0, b1, rb) in zip(taken, taken[1:]):
            if b0 < a1:
                raise RecordError(f"step {r['index']}: rows of {ra!r} and {rb!r} overlap ({a0}..{a1 - 1} and "
                                  f"{b0}..{b1 - 1})")
        # the packed input is [rows, hidden], rows = the slices' counts: each slice lies inside it
        rows = sum(s["count"] for s in r["slices"])
        for i, s in enumerate(r["slices"]):
            if s["row_offset"] + s["count"] > rows:
                raise RecordError(f"step.slices[{i}].row_offset: rows {s['row_offset']}.."
                                  f"{s['row_offset'] + s['count'] - 1} go past the step's {rows} rows (the slices' "
                                  f"counts): the slices must fill rows 0..{rows - 1} without gaps")
        # one request's slices hold each of its positions at most once
        for i, s in enumerate(r["slices"]):
            for j, o in enumerate(r["slices"][:i]):
                if o["request"] == s["request"] and s["start"] < o["start"] + o["count"] \
                        and o["start"] < s["start"] + s["count"]:
                    raise RecordError(f"step.slices[{i}].start: positions {_span(s['start'], s['count'])} of "
                                      f"{s['request']!r} overlap those of slices[{j}] "
                                      f"({_span(o['start'], o['count'])})")
        if r["model"] is None:  # pragma: no cover  (the contract's default)
            r["model"] = "target"
        self._steps.append(r)
        self._step_index[r["index"]] = r
        return r["index"]

    def _of_step(self, kind: str, r: dict) -> dict:
        st = self._step_index.get(r["step"])
        if st is None:
            raise RecordError(f"{kind}: step {r['step']} was not recorded (a step record must come first)")
        if r.get("model", "") is None:
            r["model"] = st["model"]
        return st

    def _add_kernel(self, r: dict) -> None:
        self._of_step("kernel", r)
        if r["m"] is None:
            r["m"] = r["rows"]
        self._records[r["step"]]["kernel"].append(r)

    def _add_kv_write(self, r: dict) -> None:
        st = self._of_step("kv_write", r)
        rid = r["request"]
        self._known("kv_write", rid)
        mine = [s for s in st["slices"] if s["request"] == rid]
        if not mine:
            raise RecordError(f"kv_write.request: step {r['step']} has no slice of {rid!r} (its slices: "
                              f"{_slices(st)}): a step writes K/V only at the positions of its rows")
        n = len(r["k_hashes"])
        if not any(s["start"] <= r["start"] and r["start"] + n <= s["start"] + s["count"] for s in mine):
            raise RecordError(f"kv_write.start: positions {_span(r['start'], n)} of {rid!r} are not inside one "
                              f"slice of step {r['step']} ({_slices(st, rid)}): a step writes K/V only at the "
                              f"positions of its rows")
        self._records[r["step"]]["kv_write"].append(r)

    def _add_token(self, r: dict) -> None:
        st = self._of_step("token", r)
        rid = r["request"]
        req = self._known("token", rid)
        if rid in self._finished:
            raise RecordError(f"token.request: {rid!r} already finished (step {self._finished[rid]}): no tokens after "
                              f"its finish record")
        if req["max_tokens"] is not None and len(self._generated[rid]) >= req["max_tokens"]:
            raise RecordError(f"token.position: {r['position']} would be token {len(self._generated[rid]) + 1} of "
                              f"{rid!r}, whose max_tokens is {req['max_tokens']}")
        if self.run["top_k"] is not None and len(r["topk_ids"]) > self.run["top_k"]:
            raise RecordError(f"token.topk_ids: {len(r['topk_ids'])} top-k entries but the run's top_k is "
                              f"{self.run['top_k']}")
        want = len(req["prompt"]) + len(self._generated[rid])
        if r["position"] != want:
            raise RecordError(f"token: {rid!r} position {r['position']}, but its next token is at {want} "
                              f"(prompt length + tokens so far: positions must follow each other)")
        row = r["position"] - 1
        if not any(s["request"] == rid and s["start"] <= row < s["start"] + s["count"] for s in st["slices"]):
            raise RecordError(f"token: step {r['step']} has no row of {rid!r} at position {row}, the row whose "
                              f"logits give the token at {r['position']}")
        self._generated[rid].append(r["token"])
        self._records[r["step"]]["token"].append(r)

    def _add_finish(self, r: dict) -> None:
        self._of_step("finish", r)
        rid = r["request"]
        req = self._known("finish", rid)
        if rid in self._finished:
            raise RecordError(f"finish.request: {rid!r} already finished (step {self._finished[rid]})")
        n = len(self._generated[rid])
        if r["reason"] == "length":  # it stopped because it had generated max_tokens tokens
            if req["max_tokens"] is None and not n:  # max_tokens: as many as recorded, at least one
                raise RecordError(f"finish.reason: 'length', but {rid!r} has no tokens recorded (before this "
                                  f"finish): tokens missing?")
            if req["max_tokens"] is not None and n != req["max_tokens"]:
                raise RecordError(f"finish.reason: 'length', but {rid!r} has {_tokens(n)} recorded (before this "
                                  f"finish), not its max_tokens {req['max_tokens']}: tokens missing?")
        self._finished[rid] = r["step"]
        self._records[r["step"]]["finish"].append(r)

    # -- writing ---------------------------------------------------------------------
    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if isinstance(exc, RecordError):  # a record was refused: no trace of records that break the contract
            self._closed = True
            return False
        self.close(completed=exc_type is None)
        return False

    def close(self, *, completed: bool = True) -> Path | None:
        """Write the trace (to a unique `PATH.<pid>-<random>.partial`, renamed to PATH once whole;
        removed on failure). Returns the path."""
        if self._closed:
            return self.path
        self._closed = True
        has_kv = any(g["kv_write"] for g in self._records.values())
        if has_kv and not self.run["kv_hash"]:
            raise RecordError("run: kv_write records need the hash named (kv_hash, e.g. xxh3_64)")
        top_k = self.run["top_k"] or max((len(t["topk_ids"]) for g in self._records.values() for t in g["token"]),
                                         default=1)
        for g in self._records.values():
            for t in g["token"]:
                if len(t["topk_ids"]) > top_k:
                    raise RecordError(f"token: {len(t['topk_ids'])} top-k entries but the run's top_k is {top_k}")
        info = self._run_info(top_k)
        if self.observers is not None:
            fan = _Fanout(self.observers)
            fan.on_run_start(info)
            self._emit(fan)
            fan.on_run_end(completed)
            return None
        from ..trace.writer import TraceWriter  # (lazy: loads h5py, only when writing)

        ops = [k["op"] for g in self._records.values() for k in g["kernel"]]
        kernels = [k["kernel"] for g in self._records.values() for k in g["kernel"]]
        partial = temp_name(self.path, "partial")  # unique per process: two imports never write one file
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with TraceWriter(partial, top_k=top_k, kv_hashes=has_kv, kv_hash=self.run["kv_hash"] or HASH_NAME,
                             ops=ops, kernels=kernels) as w:
                w.on_run_start(info)
                self._emit(w)
                w.on_run_end(completed)
            os.replace(partial, self.path)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        return self.path

    def _run_info(self, top_k: int) -> RunInfo:
        run = self.run
        settings = {**run["settings"], "engine": run["engine"], "policy": run["policy"], "top_k": top_k,
                    "kv_hash": run["kv_hash"], "recording_contract": CONTRACT_VERSION}
        requests = []
        for r in self._requests.values():
            try:
                requests.append(Request(r["id"], tuple(int(t) for t in r["prompt"]),
                                        max_tokens=r["max_tokens"] or max(1, len(self._generated[r["id"]])),
                                        arrival=r["arrival"], sampling=Sampling(r["temperature"], r["top_p"],
                                                                                r["seed"])))
            except PromptError as e:
                raise RecordError(f"request: {e}") from None
        model = dict(run["model"])
        model.setdefault("path", model.get("name", run["engine"]))
        return RunInfo(run["schedule"], run["policy"], settings, requests, model, None, run["environment"],
                       run["vocab"] or ())

    def _emit(self, w) -> None:
        first_step: dict[str, int] = {}
        for st in self._steps:
            idx = st["index"]
            recs = self._records.get(idx, {})
            plan = self._plan(st, recs.get("token", ()))
            for s in plan.slices:
                if s.request_id not in first_step:
                    first_step[s.request_id] = idx
                    w.on_request(RequestEvent(idx, s.request_id, "arrived"))
            for k in recs.get("kernel", ()):
                w.on_kernel(KernelChoice(idx, k["model"], k["layer"], k["op"], k["rows"], k["kernel"],
                                         k["m"], k["n"], k["k"]))
            for kv in recs.get("kv_write", ()):
                w.on_kv_write(KvWrite(idx, kv["model"], kv["request"], kv["layer"], kv["start"],
                                      len(kv["k_hashes"]), kv["k_hashes"], kv["v_hashes"]))
            for t in recs.get("token", ()):
                w.on_token(TokenEvent(idx, t["request"], t["position"], t["token"], t["spec"],
                                      t["topk_ids"].astype(np.int32), t["topk_logits"], _own_logit(t)))
            for f in recs.get("finish", ()):
                w.on_request(RequestEvent(idx, f["request"], "finished", f["reason"]))
            w.on_step(StepEvent(plan, st["duration"]))

    def _plan(self, st: dict, tokens) -> StepPlan:
        """The step as the engine's StepPlan: input tokens from the prompt and the tokens
        generated (where the engine gave none), logit rows from the tokens this step produced."""
        rows_of: dict[str, set] = defaultdict(set)
        for t in tokens:
            rows_of[t["request"]].add(t["position"] - 1)
        slices = []
        for s in st["slices"]:
            rid = s["request"]
            if s["tokens"] is not None:
                toks = tuple(int(x) for x in s["tokens"])
            else:
                seq = list(self._requests[rid]["prompt"]) + self._generated[rid]
                toks = tuple(int(seq[p]) if p < len(seq) else -1 for p in range(s["start"], s["start"] + s["count"]))
            logit_rows = tuple(sorted(p - s["start"] for p in rows_of[rid] if s["start"] <= p < s["start"] + s["count"]))
            slices.append(SeqSlice(rid, s["phase"], s["start"], s["count"], s["row_offset"], toks, logit_rows))
        return StepPlan(st["index"], st["model"], tuple(slices))


class _Fanout:
    """One observer that forwards every event to several."""

    def __init__(self, observers):
        self._observers = observers

    def __getattr__(self, method):
        return lambda *args: [getattr(ob, method)(*args) for ob in self._observers]


def _span(start: int, count: int) -> str:
    return f"{start}..{start + count - 1}"


def _tokens(n: int) -> str:
    return f"{n} token" + ("" if n == 1 else "s")


def _slices(st: dict, rid: str | None = None) -> str:
    """A step's slices (or those of one request) for a message: 'r1 decode 5..5, r2 prefill 0..2'."""
    return ", ".join(f"{s['request']} {s['phase']} {_span(s['start'], s['count'])}" for s in st["slices"]
                     if rid is None or s["request"] == rid)


def _request_fields(r) -> dict:
    if isinstance(r, dict):
        return r
    if hasattr(r, "prompt_tokens"):  # a divergence Request (or a trace's)
        return {"id": r.id, "prompt": list(r.prompt_tokens), "max_tokens": r.max_tokens, "arrival": r.arrival,
                "temperature": r.sampling.temperature, "top_p": r.sampling.top_p, "seed": r.sampling.seed}
    raise RecordError(f"request: expected a dict or a Request, got {type(r).__name__}")


def _own_logit(t: dict) -> float:
    """The chosen token's own logit: as the engine gave it, else from its top-k, else unknown (NaN)."""
    if t.get("logit") is not None:
        return float(np.float32(t["logit"]))
    hit = np.flatnonzero(np.asarray(t["topk_ids"]) == t["token"])
    return float(np.asarray(t["topk_logits"], np.float32)[hit[0]]) if hit.size else float("nan")
