"""Trace mlx-lm's own `BatchGenerator`, so its divergences get root causes too.

A thin adapter, no copy of mlx-lm's code: `BatchGenerator` runs unchanged on a
proxy of the model. The proxy sees every forward pass (which batch, which rows,
from the caller's `uids`) and, through a wrapper around the KV caches'
`update_and_fetch`, every K/V row written; it records them through `divergence.record`, the
recording contract any engine follows (step compositions, KV writes with
per-position hashes, tokens with top-k), so `diff`, `bisect` and `browse` work on
the result. Two schedules:
`serial` feeds one request at a time, `concurrent` inserts all at once.

What differs from the engine's traces: the top-k values are mlx-lm's log-probs
(logits minus logsumexp), not raw logits; no kernel choices are recorded (mlx-lm
picks none); and replay cannot re-execute them (`replay` re-runs divergence's own
engine), so `bisect --confirm` refuses these traces and plain `bisect` gives the
lead. Prompt rows that mlx-lm pads are not recorded: each slice holds the
request's real tokens only.
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager

from ..engine.kernels import blas as _blas  # noqa: F401  (loads the optimized BLAS: must precede mlx)
import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator, GenerationBatch
from mlx_lm.models import cache as mlx_cache

from ..core.events import DECODE, PREFILL, TARGET, SeqSlice, StepPlan
from ..core.names import BASE_SCHEDULES as SCHEDULES  # BatchGenerator has no warm schedule
from ..core.names import BATCH_GENERATOR, LOGPROBS
from ..core.request import Request
from ..engine import sampling as smp
from ..engine.kernels.environment import environment
from ..engine.model.loading import LoadedModel
from ..engine.kv_events import kv_writes
from ..record import Recorder

ENGINE_NAME = BATCH_GENERATOR


class _Tap:
    """Stands in for the model inside BatchGenerator and reports what each call did."""

    def __init__(self, model, prompts: dict[int, tuple[int, ...]], rid: dict[int, str], rec: Recorder):
        self._model = model
        self._prompts = prompts  # uid -> prompt tokens
        self._rid = rid  # uid -> request id
        self._rec = rec
        self.step = 0
        self.done: dict[int, int] = {}  # uid -> positions in its cache
        self.computed_at: dict[tuple[int, int], int] = {}  # (uid, position) -> step that computed it
        self._written: list[tuple] | None = None  # (keys, values) per layer, during a call

    def __getattr__(self, name):  # make_prompt_cache and friends read the model's attributes
        return getattr(self._model, name)

    def record(self, keys, values) -> None:
        if self._written is not None:
            self._written.append((keys, values))

    def __call__(self, inputs, cache=None, **kw):
        batch = sys._getframe(1).f_locals.get("self")  # the PromptProcessingBatch / GenerationBatch calling
        uids = list(batch.uids)
        tokens = np.array(inputs)
        decode = isinstance(batch, GenerationBatch)
        n = tokens.shape[1]
        counts, starts = [], []
        for uid in uids:
            done = self.done.get(uid, 0)
            # prompt rows are right-padded: the real ones come first
            counts.append(n if decode else max(0, min(n, len(self._prompts[uid]) - 1 - done)))
            starts.append(done)
        self._written = []
        t0 = time.perf_counter()
        out = self._model(inputs, cache=cache, **kw)
        written, self._written = self._written, None
        mx.eval(out, *[a for kv in written for a in kv])
        duration = time.perf_counter() - t0
        slices, offset = [], 0
        for b, (uid, c, s) in enumerate(zip(uids, counts, starts)):
            if c == 0:
                continue
            slices.append(SeqSlice(self._rid[uid], DECODE if decode else PREFILL, s, c, offset,
                                   tuple(int(t) for t in tokens[b, :c]), (c - 1,) if decode else ()))
            offset += c
            self.done[uid] = s + c
            for p in range(s, s + c):
                self.computed_at[(uid, p)] = self.step
        plan = StepPlan(self.step, TARGET, tuple(slices))
        if slices:
            self._rec.step(plan.slices, index=self.step, duration=duration)
        if slices and written:
            # [layers, B, heads, L, dim] -> the real rows of each slice, [layers, T, heads, dim]
            rows = [(b, c) for b, c in enumerate(counts) if c]
            k = mx.stack([mx.concatenate([kk[b, :, :c].transpose(1, 0, 2) for b, c in rows]) for kk, _ in written])
            v = mx.stack([mx.concatenate([vv[b, :, :c].transpose(1, 0, 2) for b, c in rows]) for _, vv in written])
            for w in kv_writes(plan, TARGET, k, v):
                self._rec.kv_write(w.request_id, layer=w.layer, start=w.start, k_hashes=w.k_hashes,
                                   v_hashes=w.v_hashes, step=w.step)
        self.step += 1
        return out


@contextmanager
def _kv_taps(tap: _Tap):
    """Every K/V row the caches store passes through tap.record (restored afterwards)."""
    classes = [c for c in (getattr(mlx_cache, n, None) for n in ("KVCache", "BatchKVCache")) if c is not None]
    originals = {c: c.update_and_fetch for c in classes}

    def wrap(orig):
        def update_and_fetch(self, keys, values):
            tap.record(keys, values)
            return orig(self, keys, values)
        return update_and_fetch

    for c in classes:
        c.update_and_fetch = wrap(originals[c])
    try:
        yield
    finally:
        for c, f in originals.items():
            c.update_and_fetch = f


def run_batch_generator(loaded: LoadedModel, requests: list[Request], schedule: str, observers=(), *,
                        top_k: int = 8, prefill_step_size: int = 2048) -> dict[str, list[int]]:
    """Run mlx-lm's BatchGenerator (greedy) over `requests` under `schedule`, recording it
    through divergence.record (as any other engine would) and sending the events to
    `observers` (e.g. a TraceWriter) at the end. Returns request id -> tokens."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r} (expected {', '.join(SCHEDULES)})")
    settings = {"token_budget": prefill_step_size, "spec_k": 0, "block_size": 0, "prefix_caching": False,
                "stop_at_eos": False, "dtype": loaded.dtype, "topk_values": LOGPROBS}
    vocab = [loaded.decode([i]) for i in range(_vocab_size(loaded))]
    rec = Recorder(engine=ENGINE_NAME, schedule=schedule, requests=requests, top_k=top_k, policy="native",
                   model=loaded.describe(), settings=settings, environment=environment(), vocab=vocab,
                   observers=observers)
    prompts, rid = {}, {}
    tap = _Tap(loaded.model, prompts, rid, rec)
    gen = BatchGenerator(tap, max_tokens=max(r.max_tokens for r in requests),
                         completion_batch_size=max(32, len(requests)), prefill_batch_size=max(8, len(requests)),
                         prefill_step_size=prefill_step_size)
    out: dict[str, list[int]] = {r.id: [] for r in requests}
    completed = False
    try:
        with _kv_taps(tap):
            groups = [[r] for r in requests] if schedule == "serial" else [list(requests)]
            for group in groups:
                uids = gen.insert([list(r.prompt_tokens) for r in group], [r.max_tokens for r in group])
                for uid, r in zip(uids, group):
                    prompts[uid], rid[uid] = tuple(r.prompt_tokens), r.id
                while responses := gen.next_generated():
                    for resp in responses:
                        r_id = rid[resp.uid]
                        pos = len(prompts[resp.uid]) + len(out[r_id])
                        ids, vals = smp.topk(np.array(resp.logprobs.astype(mx.float32))[None], top_k)
                        step = tap.computed_at[(resp.uid, pos - 1)]
                        out[r_id].append(int(resp.token))
                        rec.token(r_id, position=pos, token=int(resp.token), topk_ids=ids[0],
                                  topk_logits=vals[0], step=step)
                        if resp.finish_reason is not None:
                            rec.finish(r_id, reason=resp.finish_reason, step=step)
        completed = True
    finally:
        gen.close()
        rec.close(completed=completed)
    return out


def _vocab_size(loaded: LoadedModel) -> int:
    args = loaded.model.args
    return int(getattr(args, "vocab_size"))
