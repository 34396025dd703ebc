"""Re-run a live trace's requests under another schedule: the reference trace of the pair.

Each request runs with its recorded prompt, sampling settings and seed, and stops where the
live request stopped: a client may have left, or a stop string ended it, before max_tokens.
The reference trace records the requests as the live trace does (max_tokens as asked), so
diff, bisect --confirm, report and browse take the (rerun, live) pair as they take `run`'s.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from ..core.names import BASE_SCHEDULES, BATCH_GENERATOR, SERIAL
from ..core.request import Request
from ..engine.engine import Engine
from ..engine.run import Run
from ..errors import DivergenceInputError, PromptError
from ..trace.reader import Trace
from ..trace.redact import is_redacted
from ..trace.writer import TraceWriter
from ..workloads.runner import partial_name, validate
from .private import TRACE_MODE, make_dir

RERUN_SCHEDULES = BASE_SCHEDULES  # a live trace is concurrent; warm's warm-up is not its traffic
NOT_CHOSEN = "not in --requests"  # a left-out request that had tokens live: diff reports it missing


def recorded_requests(live) -> list[Request]:
    """The live trace's requests as the engine takes them (arrival: the step each came in)."""
    return [Request(r.id, tuple(r.prompt_tokens), max_tokens=r.max_tokens, arrival=r.arrival, sampling=r.sampling)
            for r in live.requests]


def live_lengths(live, request_ids=None) -> dict[str, int]:
    """Tokens each request (of `request_ids`: only those, read through Trace.select's
    ranges) generated in the live trace."""
    if request_ids is not None:
        live.select(request_ids)
        return {rid: len(live.tokens(rid).tokens) for rid in request_ids}
    t = live.table("tokens", raw=True)
    counts = np.bincount(t["request"].astype(np.int64), minlength=len(live.requests))
    return {r.id: int(counts[i]) for i, r in enumerate(live.requests)}


def plan_rerun(live, request_ids=None) -> tuple[list[Request], list[Request], dict[str, str]]:
    """(requests as recorded, requests as the rerun runs them: capped at the live length,
    ids left out with why). A request the live server never gave a token is left out."""
    recorded = recorded_requests(live)
    known = {r.id for r in recorded}
    if request_ids is not None:
        unknown = [i for i in request_ids if i not in known]
        if unknown:
            raise PromptError(f"--requests: no request {unknown[0]!r} in {live.path} ({len(known)} requests)")
    lengths = live_lengths(live, request_ids)
    run, skipped = [], {}
    for r in recorded:
        if request_ids is not None and r.id not in request_ids:
            skipped[r.id] = NOT_CHOSEN
            continue
        n = lengths[r.id]
        if n == 0:
            skipped[r.id] = "the live request got no token (cancelled before its first)"
        else:
            run.append(replace(r, max_tokens=min(r.max_tokens, n)))
    if not run:
        raise PromptError(f"{live.path}: no request to re-run (none of those chosen generated a token)")
    return recorded, run, skipped


def prefix_sources(live, request_ids) -> dict[str, list[str]]:
    """The requests whose K/V the requests `request_ids` read through the prefix cache, and
    the ones theirs came from, to the requests that computed their own: source id -> the
    ids that read it, sources in trace order. A re-run of `request_ids` alone would compute
    those positions itself, in other steps of other shapes: its reference would not be the
    one the whole re-run gives. Empty without a prefix cache."""
    settings = live.meta.get("settings") or {}
    if not settings.get("prefix_caching"):
        return {}
    chosen = list(dict.fromkeys(request_ids))
    readers: dict[str, list[str]] = {}
    todo = list(chosen)
    while todo:
        rid = todo.pop()
        for src in _read_from(live, rid, settings):
            if src not in chosen:
                if src not in readers:
                    todo.append(src)
                readers.setdefault(src, []).append(rid)
    order = {r.id: i for i, r in enumerate(live.requests)}
    return {src: readers[src] for src in sorted(readers, key=order.get)}


def _read_from(live, rid: str, settings: dict) -> set[str]:
    """The requests whose writes `rid` inherited from the prefix cache: its K/V records of a
    step it had no part in name the step that wrote them, whose slices name the writer. A
    trace without K/V records: every earlier request with a full block of its prompt."""
    if not live.has_kv_hashes:
        bs = int(settings.get("block_size") or 16)
        me = live.requests[live.request_index(rid)]
        head = tuple(me.prompt_tokens[:bs])
        return {r.id for r in live.requests if r.id != rid and len(head) == bs and r.arrival <= me.arrival
                and tuple(r.prompt_tokens[:bs]) == head}
    w = live.kv_write_rows(rid)
    out: set[str] = set()
    for step in np.unique(w["step"]):
        plan = live.step_plan(int(step))
        if any(s.request_id == rid for s in plan.slices):
            continue  # its own computation
        sel = w["step"] == step
        for start, count in zip(w["start"][sel].tolist(), w["count"][sel].tolist()):
            out.update(s.request_id for s in plan.slices
                       if s.request_id != rid and s.start < start + count and start < s.start + s.count)
    return out


def rerun(live_path, out_dir, *, schedule: str = SERIAL, request_ids=None, model_dir=None, draft_dir=None,
          observers=()):
    """Write out_dir/<schedule>.h5; returns (its path, RunResult, skipped ids -> why). With
    request_ids, the requests whose prefix-cache blocks they read are re-run too (the
    result's `prefix_sources`: source -> readers). observers: more engine observers (a
    progress line)."""
    if schedule not in RERUN_SCHEDULES:
        raise PromptError(f"--schedule {schedule!r}: expected {' or '.join(RERUN_SCHEDULES)}")
    sources: dict[str, list[str]] = {}
    with Trace.open(live_path) as live:
        if is_redacted(live):
            raise DivergenceInputError(f"{live_path} is redacted (divergence redact): its token ids are permuted, "
                                       f"and a re-run needs the real prompts; re-run the original trace")
        meta = live.meta
        if request_ids is not None:
            known = {r.id for r in live.requests}
            if all(i in known for i in request_ids):  # (an unknown id: plan_rerun says so)
                sources = prefix_sources(live.select(request_ids), request_ids)  # (their rows only)
                request_ids = list(dict.fromkeys(request_ids)) + list(sources)
        recorded, requests, skipped = plan_rerun(live, request_ids)
        kv_hashes = live.has_kv_hashes
        vocab = live.vocab if meta["settings"].get("engine") == BATCH_GENERATOR else None
    if meta["settings"].get("engine") == BATCH_GENERATOR:  # served by mlx-lm: its engine is the reference
        from .mlxlm_rerun import rerun_batch_generator  # (lazy: loads mlx-lm)

        out = _out_dir(out_dir) / f"{schedule}.h5"
        result = rerun_batch_generator(live_path, meta, vocab, recorded, requests, skipped, out, schedule=schedule,
                                       chosen=request_ids, model_dir=model_dir)
        result.prefix_sources = sources
        return out, result, skipped
    engine = Engine.from_settings(meta["settings"], model=meta["model"], draft=meta.get("draft"),
                                  model_dir=model_dir, draft_dir=draft_dir)
    validate(engine, requests)  # the rules `divergence run` applies
    path = _out_dir(out_dir) / f"{schedule}.h5"
    tmp = partial_name(path)
    by_id = {r.id: r for r in requests}
    try:
        with TraceWriter(tmp, top_k=engine.top_k, kv_hashes=kv_hashes, mode=TRACE_MODE) as writer:
            engine.observers = [writer, *observers]
            run = CappedRun(engine, [by_id.get(r.id, r) for r in recorded], schedule, recorded, skipped,
                            of={"live": str(live_path), "requests": [r.id for r in requests] if request_ids else None})
            result = run.execute()
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        engine.observers = []
    tmp.replace(path)
    result.prefix_sources = sources
    return path, result, skipped


def _out_dir(out_dir) -> Path:
    out = Path(out_dir)
    try:
        make_dir(out)
    except OSError as e:
        raise DivergenceInputError(f"cannot create --out {out}: {e.strerror or e}") from None
    return out


class CappedRun(Run):
    """Runs each request to its live length; the trace records the requests as recorded
    (max_tokens as the client asked), so the pair compares request for request. Its
    settings name what it re-ran ("rerun": the live trace, and the ids re-run where
    --requests chose some, else None: all)."""

    def __init__(self, engine, requests, schedule, recorded, skipped, *, of: dict):
        super().__init__(engine, requests, schedule, bad=skipped)
        self._recorded = list(recorded)
        self._of = dict(of)

    def info(self):
        info = super().info()
        return replace(info, requests=self._recorded, settings={**info.settings, "rerun": self._of})
