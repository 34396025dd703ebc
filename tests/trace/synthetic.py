"""Synthetic engine events: trace tests need no model."""
from __future__ import annotations

import numpy as np

from divergence.core.events import (
    KernelChoice, KvWrite, RequestEvent, RunInfo, SeqSlice, StepEvent, StepPlan, TokenEvent,
)
from divergence.core.request import Request, Sampling

REQUESTS = [Request("r1", (1, 2, 3), max_tokens=4, arrival=0), Request("r2", (4, 5), max_tokens=3, arrival=1,
                                                                        sampling=Sampling(0.7, 0.9, 11))]


def info():
    return RunInfo(schedule="concurrent", policy="threshold:4", settings={"top_k": 4, "spec_k": 0},
                   requests=REQUESTS, model={"path": "/m", "weights_hash": "abc", "dtype": "bfloat16"},
                   draft=None, environment={"mlx": "0.32.4"}, vocab=["a", "b\x00", "ç", "d", "e", "f"])


def odd_floats(rng, n):
    """float32 values with unusual bit patterns (subnormals, -0.0, large), never NaN."""
    bits = rng.integers(0, 2**31 - 2**23, size=n, dtype=np.uint32)  # below the NaN/inf exponent
    bits |= (rng.integers(0, 2, size=n, dtype=np.uint32) << 31)
    return bits.view(np.float32)


def emit_run(writer, steps=6, *, rng=None, end=True, on_step=None):
    """Drive a writer like the engine would; returns everything emitted."""
    rng = rng or np.random.default_rng(0)
    writer.on_run_start(info())
    emitted = {"plans": [], "kernels": [], "kv": [], "tokens": []}
    pos = {"r1": 0, "r2": 0}
    for step in range(steps):
        slices, row = [], 0
        for rid, n in (("r1", 3 if step == 0 else 1), ("r2", 2 if step == 1 else 1)):
            if step == 0 and rid == "r2":
                continue
            toks = tuple(int(t) for t in rng.integers(0, 6, n))
            slices.append(SeqSlice(rid, "prefill" if pos[rid] == 0 else "decode", pos[rid], n, row, toks, (n - 1,)))
            row += n
        plan = StepPlan(step, "target", tuple(slices))
        for layer in range(2):
            for op in ("q_proj", "k_proj"):
                c = KernelChoice(step, "target", layer, op, plan.rows, "gemm" if plan.rows > 2 else "gemv",
                                 plan.rows, 8, 8, 4 if plan.rows > 2 else 1)
                writer.on_kernel(c)
                emitted["kernels"].append(c)
        for s in slices:
            for layer in range(2):
                w = KvWrite(step, "target", s.request_id, layer, s.start, s.count,
                            rng.integers(0, 2**63, s.count).astype(np.uint64),
                            rng.integers(0, 2**63, s.count).astype(np.uint64))
                writer.on_kv_write(w)
                emitted["kv"].append(w)
        for s in slices:
            t = TokenEvent(step, s.request_id, s.start + s.count, int(rng.integers(0, 6)), step % 3,
                           rng.permutation(6)[:4].astype(np.int32), odd_floats(rng, 4))
            writer.on_token(t)
            emitted["tokens"].append(t)
            pos[s.request_id] = s.start + s.count
        writer.on_step(StepEvent(plan, 0.001 * step))
        emitted["plans"].append(plan)
        if on_step:
            on_step(step)
    writer.on_request(RequestEvent(steps - 1, "r1", "finished", "length"))
    if end:
        writer.on_run_end(True)
    return emitted
