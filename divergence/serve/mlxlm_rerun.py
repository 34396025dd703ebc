"""`divergence rerun` of a live trace that mlx-lm's BatchGenerator served (serve --engine
mlx-lm): the reference is mlx-lm's engine again, one request at a time, traced through the
recording adapter's proxy; divergence's engine would answer another question.

Greedy requests only: BatchGenerator samples from one global random state, so a sampled
request's tokens cannot be drawn again (they are left out, and the pair compares the rest).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from ..engine.kernels import blas as _blas  # noqa: F401  (loads the optimized BLAS: must precede mlx)
import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator

from ..core.names import SERIAL
from ..engine import sampling as smp
from ..engine.kernels.environment import environment
from ..engine.model.loading import load_cached
from ..errors import PromptError
from ..record import Recorder
from ..workloads.mlxlm_batch import ENGINE_NAME, _kv_taps, _Tap
from .mlxlm import COMPLETION_BATCH, PREFILL_BATCH, PREFILL_STEP, settings
from .private import private_place, publish

SAMPLED = "sampled: mlx-lm draws from one global random state, so its tokens cannot be drawn again"
LIVE_LENGTH = "live-length"  # a finish where the live request ended (a stop string, a client gone)


@dataclass
class Result:
    """What `divergence rerun` prints of a re-run."""

    outputs: dict[str, list[int]] = field(default_factory=dict)
    generated_tokens: int = 0
    steps: int = 0
    target_steps: int = 0
    seconds: float = 0.0


def rerun_batch_generator(live_path, meta: dict, vocab, recorded, requests, skipped: dict, path: Path, *,
                          schedule: str, chosen, model_dir=None) -> Result:
    """Run `requests` (capped at their live lengths) through BatchGenerator one at a time;
    the trace at `path` declares `recorded` (max_tokens as asked), so diff pairs it with the
    live trace request for request. skipped: ids left out -> why (sampled ones are added)."""
    if schedule != SERIAL:
        raise PromptError(f"--schedule {schedule}: a trace of mlx-lm's BatchGenerator re-runs serially (the live "
                          f"trace is its batched run)")
    greedy = []
    for r in requests:
        if r.sampling.greedy:
            greedy.append(r)
        else:
            skipped[r.id] = SAMPLED
    if not greedy:
        raise PromptError(f"{live_path}: no request to re-run: every one chosen was sampled (temperature > 0), and "
                          f"mlx-lm's BatchGenerator cannot draw a sampled request's tokens again")
    loaded = load_cached(model_dir or meta["model"]["path"], dtype=meta["settings"].get("dtype"))
    want = meta["model"].get("weights_hash")
    if want and loaded.weights_hash != want:
        raise PromptError(f"the model at {loaded.path} is not the one {live_path} recorded (weights hash "
                          f"{loaded.weights_hash[:12]} vs {want[:12]}): pass --model DIR")
    s = dict(meta["settings"])
    top_k = int(s.get("top_k") or 8)
    subset = [r.id for r in greedy] if (chosen is not None or any(w == SAMPLED for w in skipped.values())) else None
    run_settings = {**settings(loaded, top_k=top_k, stop_at_eos=bool(s.get("stop_at_eos"))),
                    "rerun": {"live": str(live_path), "requests": subset}}
    for key in ("engine", "policy", "top_k", "kv_hash", "recording_contract"):  # (the Recorder adds its own)
        run_settings.pop(key, None)
    # the Recorder names its own partial file beside tmp: a private directory keeps both to their owner
    with private_place(path) as tmp:
        rec = Recorder(tmp, engine=ENGINE_NAME, schedule=SERIAL, requests=recorded, top_k=top_k, policy="native",
                       model=loaded.describe(), settings=run_settings, environment=environment(),
                       vocab=list(vocab) if vocab else None)
        prompts, rid = {}, {}
        tap = _Tap(loaded.model, prompts, rid, rec)
        as_asked = {r.id: r.max_tokens for r in recorded}
        eos = sorted(int(t) for t in getattr(loaded.tokenizer, "eos_token_ids", None) or ())
        stops = [[t] for t in eos] if s.get("stop_at_eos") and eos else None
        gen = BatchGenerator(tap, stop_tokens=stops, completion_batch_size=COMPLETION_BATCH,
                             prefill_batch_size=PREFILL_BATCH, prefill_step_size=PREFILL_STEP)
        out = Result()
        t0 = time.perf_counter()
        try:
            try:
                with _kv_taps(tap):
                    for r in greedy:
                        _one(gen, tap, rec, r, as_asked[r.id], prompts, rid, out.outputs.setdefault(r.id, []), top_k)
            finally:
                gen.close()
            rec.close(completed=True)
            publish(tmp, path)
        except BaseException:
            rec._closed = True  # (nothing more to write: the partial file goes)
            tmp.unlink(missing_ok=True)
            raise
    out.seconds = time.perf_counter() - t0
    out.generated_tokens = sum(len(t) for t in out.outputs.values())
    out.steps = out.target_steps = tap.step
    for r in recorded:
        out.outputs.setdefault(r.id, [])
    return out


def _one(gen, tap, rec, r, as_asked: int, prompts, rid, toks: list, top_k: int) -> None:
    """One request through BatchGenerator, alone, to its live length."""
    [uid] = gen.insert([list(r.prompt_tokens)], [r.max_tokens])
    prompts[uid], rid[uid] = tuple(r.prompt_tokens), r.id
    while responses := gen.next_generated():
        for resp in responses:
            pos = len(prompts[resp.uid]) + len(toks)
            ids, vals = smp.topk(np.array(resp.logprobs.astype(mx.float32))[None], top_k)
            step = tap.computed_at[(resp.uid, pos - 1)]
            toks.append(int(resp.token))
            rec.token(r.id, position=pos, token=int(resp.token), topk_ids=ids[0], topk_logits=vals[0], step=step)
            if resp.finish_reason is not None:
                reason = resp.finish_reason
                if reason == "length" and len(toks) < as_asked:
                    reason = LIVE_LENGTH  # the live request ended here (a stop string, a client gone)
                rec.finish(r.id, reason=reason, step=step)
