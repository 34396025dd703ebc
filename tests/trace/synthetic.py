"""Synthetic engine events: trace tests need no model."""
from __future__ import annotations

import numpy as np

from divergence.engine.events import (
    KernelChoice, KvWrite, RequestEvent, RunInfo, SeqSlice, StepEvent, StepPlan, TokenEvent,
)
from divergence.engine.request import Request, Sampling

REQUESTS = [Request("r1", (1, 2, 3), max_tokens=4, arrival=0), Request("r2", (4, 5), max_tokens=3, arrival=1,
                                                                        sampling=Sampling(0.7, 0.9, 11))]
VOCAB = ["a", "b\x00", "ç", "d", "e", "f"]


def info(requests=REQUESTS):
    return RunInfo(schedule="concurrent", policy="threshold:4", settings={"top_k": 4, "spec_k": 2},
                   requests=requests, model={"path": "/m", "weights_hash": "abc", "dtype": "bfloat16"},
                   draft={"path": "/d"}, environment={"mlx": "0.32.4"}, vocab=VOCAB)


def odd_floats(rng, n):
    """float32 values with unusual bit patterns (subnormals, -0.0, huge), never NaN or inf."""
    bits = rng.integers(0, 0x7F800000, size=n, dtype=np.uint32)  # below the inf/NaN exponent
    bits |= rng.integers(0, 2, size=n, dtype=np.uint32) << np.uint32(31)
    bits[: min(n, 3)] = [0x80000000, 0x00000001, 0x7F7FFFFF][: min(n, 3)]  # -0.0, smallest subnormal, max
    return bits.view(np.float32)


def emit_run(writer, steps=6, *, rng=None, end=True, on_step=None):
    """Drive a writer like the engine would (a draft step every third step, verify
    slices of 3 rows, request events); returns everything emitted."""
    rng = rng or np.random.default_rng(0)
    writer.on_run_start(info())
    emitted = {"plans": [], "kernels": [], "kv": [], "tokens": []}
    pos = {"r1": 0, "r2": 0}
    writer.on_request(RequestEvent(0, "r1", "arrived", "prefix_hit=0"))
    for step in range(steps):
        if step == 1:
            writer.on_request(RequestEvent(1, "r2", "arrived"))
        model = "draft" if step % 3 == 2 else "target"
        slices, row = [], 0
        for rid in ("r1", "r2"):
            if step == 0 and rid == "r2":
                continue
            fresh = pos[rid] == 0
            n = 3 if fresh or model == "target" and step % 3 == 1 else 1
            phase = "prefill" if fresh else ("draft" if model == "draft" else ("verify" if n == 3 else "decode"))
            toks = tuple(int(t) for t in rng.integers(0, 6, n))
            logit_rows = tuple(range(n)) if phase == "verify" else (n - 1,)
            slices.append(SeqSlice(rid, phase, pos[rid], n, row, toks, logit_rows))
            row += n
        plan = StepPlan(step, model, tuple(slices))
        for layer in range(3):
            for op in (("q_proj", "k_proj") if layer < 2 else ("lm_head",)):
                c = KernelChoice(step, model, layer, op, plan.rows, "gemm" if plan.rows > 2 else "gemv",
                                 plan.rows, 8, 8, 4 if plan.rows > 2 else 1)
                writer.on_kernel(c)
                emitted["kernels"].append(c)
        for s in slices:
            for layer in range(2):
                w = KvWrite(step, model, s.request_id, layer, s.start, s.count,
                            rng.integers(0, 2**64, s.count, dtype=np.uint64),
                            rng.integers(0, 2**64, s.count, dtype=np.uint64))
                writer.on_kv_write(w)
                emitted["kv"].append(w)
        if model == "target":
            for s in slices:
                accepted = 1 if s.phase == "verify" else 0  # a verify: one accepted + one corrected
                for j in range(accepted + 1):
                    t = TokenEvent(step, s.request_id, s.start + s.count + j, int(rng.integers(0, 6)),
                                   (1 if j < accepted else 2) if accepted else 0,
                                   rng.permutation(6)[:4].astype(np.int32), odd_floats(rng, 4))
                    writer.on_token(t)
                    emitted["tokens"].append(t)
                pos[s.request_id] = s.start + s.count + accepted
        writer.on_step(StepEvent(plan, 0.001 * (step + 1)))
        emitted["plans"].append(plan)
        if on_step:
            on_step(step)
    writer.on_request(RequestEvent(steps - 1, "r1", "finished", "length"))
    writer.on_request(RequestEvent(steps - 1, "r2", "error", "prompt too long — ç"))
    if end:
        writer.on_run_end(True)
    return emitted
