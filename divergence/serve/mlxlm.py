"""`divergence serve --engine mlx-lm`: the same HTTP API, served by mlx-lm's own
`BatchGenerator` (mlx_lm.server's engine), so the live trace is of the engine users run.

BatchGenerator runs unchanged on the recording adapter's proxy of the model
(workloads.mlxlm_batch: each forward's batch and rows, each K/V row written). Where
`divergence import` and the adapter keep a run's records until it ends, a server's must be
on disk as it goes: `Stream` turns the proxy's step and K/V records into the engine's own
events for the trace writer as they happen, and the tokens as BatchGenerator returns them.
The trace is an ordinary BatchGenerator trace (settings.engine, log-prob top-k values), so
diff, bisect and browse read it, and replay stands divergence's engine in for it.

Requests join between BatchGenerator steps (its `insert`), leave on a disconnect or a stop
string (its `remove`), and arrive at the step count when they came in, as the engine's live
runs record them. Sampling: mlx-lm's sampler (temperature, top_p); mlx-lm draws from one
global random state, so a request's seed is recorded but does not fix its tokens.
"""
from __future__ import annotations

import math
import time
from importlib.metadata import version

from ..engine.kernels import blas as _blas  # noqa: F401  (loads the optimized BLAS: must precede mlx)
import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_sampler

from ..core.events import SPEC_NONE, KvWrite, RequestEvent, RunInfo, StepEvent, StepPlan, TokenEvent
from ..core.hashing import HASH_NAME
from ..core.names import CONCURRENT, LOGPROBS, TARGET
from ..core.request import Request
from ..engine import sampling as smp
from ..engine.kernels.environment import environment
from ..record.contract import CONTRACT_VERSION
from ..trace.writer import TraceWriter
from ..workloads.mlxlm_batch import ENGINE_NAME, _kv_taps, _Tap  # (the adapter's proxy and cache taps)
from .live import CANCELLED, STOP, Deliver, LiveRequest
from .private import TRACE_MODE
from .worker import EngineWorker

PREFILL_STEP = 2048  # mlx_lm.server's prefill_step_size
COMPLETION_BATCH, PREFILL_BATCH = 32, 8  # mlx_lm.server's defaults


def settings(loaded, *, top_k: int, stop_at_eos: bool) -> dict:
    """A BatchGenerator trace's settings, as the adapter records them (analysis.replayer reads them)."""
    return {"token_budget": PREFILL_STEP, "spec_k": 0, "block_size": 0, "prefix_caching": False,
            "stop_at_eos": stop_at_eos, "dtype": loaded.dtype, "topk_values": LOGPROBS, "engine": ENGINE_NAME,
            "policy": "native", "top_k": top_k, "kv_hash": HASH_NAME, "recording_contract": CONTRACT_VERSION}


class Stream:
    """Stands in for the adapter's Recorder: the proxy's records, as events, to `observers`
    (the trace writer, the sinks' Deliver) when they are made. A step's own event waits for
    the next one (or `flush`), so its K/V writes come first, as the engine emits them."""

    def __init__(self, observers, *, kv: bool = True):
        self.observers = list(observers)
        self.kv = kv  # K/V hashes wanted (serve --no-kv-hashes: not)
        self.arrived: set[str] = set()
        self._pending: tuple[StepPlan, float] | None = None
        self._writes: list[KvWrite] = []
        self.last_step = -1  # the last step emitted

    def emit(self, method: str, event) -> None:
        for ob in self.observers:
            getattr(ob, method)(event)

    def step(self, slices, *, index: int, duration: float = 0.0) -> int:
        self.flush()
        for s in slices:
            if s.request_id not in self.arrived:
                self.arrived.add(s.request_id)
                self.emit("on_request", RequestEvent(index, s.request_id, "arrived"))
        self._pending = (StepPlan(index, TARGET, tuple(slices)), duration)
        return index

    def kv_write(self, request: str, *, layer: int, start: int, k_hashes, v_hashes, step: int) -> None:
        if self.kv:
                self._writes.append(KvWrite(step, TARGET, request, layer, start, len(k_hashes), np.asarray(k_hashes),
                                        np.asarray(v_hashes)))

    def flush(self) -> None:
        if self._pending is None:
            return
        (plan, duration), self._pending = self._pending, None
        for w in self._writes:
            self.emit("on_kv_write", w)
        self._writes = []
        self.emit("on_step", StepEvent(plan, duration))
        self.last_step = plan.index


class BatchGeneratorRun:
    """One trace segment: BatchGenerator's loop, fed between its steps from the inbox."""

    def __init__(self, engine, worker: "MlxLmWorker", writer: TraceWriter, deliver: Deliver, rotate):
        self.e, self.worker, self.writer, self.deliver, self.rotate = engine, worker, writer, deliver, rotate
        self.inbox = worker.inbox
        self.stream = Stream([writer, deliver], kv=worker.kv_hashes)
        self.prompts: dict[int, tuple[int, ...]] = {}  # uid -> prompt tokens (the proxy reads them)
        self.rid: dict[int, str] = {}  # uid -> request id
        self.uid: dict[str, int] = {}
        self.count: dict[str, int] = {}  # request id -> tokens so far
        self.tap = _Tap(engine.target.model, self.prompts, self.rid, self.stream)
        stops = [[t] for t in sorted(engine.eos_ids)] if engine.stop_at_eos else None
        self.gen = BatchGenerator(self.tap, stop_tokens=stops, completion_batch_size=COMPLETION_BATCH,
                                  prefill_batch_size=PREFILL_BATCH, prefill_step_size=PREFILL_STEP)
        self.taken = 0

    def info(self) -> RunInfo:
        loaded = self.e.target
        serve = {"started": time.time(), "engine": "mlx-lm", "mlx_lm": version("mlx-lm")}
        s = {**settings(loaded, top_k=self.e.top_k, stop_at_eos=self.e.stop_at_eos), "serve": serve}
        return RunInfo(CONCURRENT, "native", s, [], loaded.describe(), None, environment(), self.e.vocab_pieces())

    def execute(self) -> None:
        try:
            with _kv_taps(self.tap):
                while self._more():
                    for resp in self.gen.next_generated():
                        self._token(resp)
                    self.stream.flush()
        finally:
            self.stream.flush()
            self.gen.close()

    # -- between steps ----------------------------------------------------------------------
    def _more(self) -> bool:
        while True:
            self._deliver_finished()
            rotating = self.rotate() and self.taken > 0
            subs, cancels = self.inbox.take(submissions=not rotating)
            for rid, reason in cancels.items():
                self._cancel(rid, reason)
            for lr in subs:
                self._add(lr)
            if self.uid:
                return True
            self._deliver_finished()
            if rotating or self.inbox.stopping:
                return False
            self.writer.flush()  # idle: everything so far on disk
            self.inbox.wait(0.25)

    def _add(self, lr: LiveRequest) -> None:
        s = lr.sampling
        req = Request(lr.id, tuple(lr.prompt_tokens), max_tokens=lr.max_tokens, arrival=self.tap.step, sampling=s,
                      prompt_text=lr.prompt_text)
        self.writer.on_request_added(req)  # its row before any event names it
        sampler = None if s.greedy else make_sampler(temp=s.temperature, top_p=s.top_p)
        [uid] = self.gen.insert([list(lr.prompt_tokens)], [lr.max_tokens], samplers=[sampler])
        self.prompts[uid], self.rid[uid], self.uid[lr.id], self.count[lr.id] = req.prompt_tokens, lr.id, uid, 0
        self.deliver.sinks[lr.id] = lr.sink
        self.taken += 1
        lr.sink.joined(self.writer.path)

    def _cancel(self, rid: str, reason: str) -> None:
        uid = self.uid.get(rid)
        if uid is None:
            return
        self.gen.remove([uid])
        kind = "finished" if reason == STOP else CANCELLED
        self._end(rid, RequestEvent(max(self.stream.last_step, 0), rid, kind, reason))

    def _token(self, resp) -> None:
        rid = self.rid.get(resp.uid)
        if rid is None:  # removed meanwhile
            return
        n = self.count[rid]
        pos = len(self.prompts[resp.uid]) + n
        step = self.tap.computed_at[(resp.uid, pos - 1)]
        lp = np.array(resp.logprobs.astype(mx.float32))
        ids, vals = smp.topk(lp[None], self.e.top_k)
        own = float(lp[int(resp.token)])
        self.count[rid] = n + 1
        self.stream.emit("on_token", TokenEvent(step, rid, pos, int(resp.token), SPEC_NONE, ids[0], vals[0], own,
                                                math.exp(own)))
        if resp.finish_reason is not None:
            self._end(rid, RequestEvent(step, rid, "finished", resp.finish_reason))

    def _end(self, rid: str, event: RequestEvent) -> None:
        uid = self.uid.pop(rid)
        self.stream.emit("on_request", event)
        n = len(self.prompts[uid]) + self.count.pop(rid)
        for p in range(n):  # a server runs for days: keep nothing of a finished request
            self.tap.computed_at.pop((uid, p), None)
        self.tap.done.pop(uid, None)
        del self.prompts[uid], self.rid[uid]

    def _deliver_finished(self) -> None:
        if not self.deliver.finished:
            return
        self.stream.flush()
        self.writer.flush()  # a client has its whole answer once its request is on disk
        done, self.deliver.finished = self.deliver.finished, []
        for rid, reason in done:
            sink = self.deliver.sinks.pop(rid, None)
            if sink is not None:
                sink.done(reason)


class MlxLmWorker(EngineWorker):
    """EngineWorker's segments, each a BatchGeneratorRun instead of the engine's LiveRun.
    `engine`: a divergence Engine over the model (no draft), for what the HTTP side asks of
    it (tokenizer, vocabulary pieces, context checks, top-k); its forward never runs."""

    def _run_segment(self) -> None:
        path = self._next_path()
        rotate = self._rotation(path)
        writer = TraceWriter(path, top_k=self.engine.top_k, kv_hashes=self.kv_hashes, mode=TRACE_MODE)
        deliver = Deliver()
        self._deliver = deliver
        run = BatchGeneratorRun(self.engine, self, writer, deliver, rotate)
        completed = False
        with writer:
            writer.on_run_start(run.info())
            writer.flush()
            self._segment_ready(path)
            try:
                run.execute()
                completed = True
            finally:
                writer.on_run_end(completed)
