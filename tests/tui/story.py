"""Synthetic trace pairs that tell seed 000's story, without a model.

A (serial) runs each request alone. B (concurrent) batches r2's long prefill
with r1's decode in one step (`CONTAMINATING_STEP`): under threshold:4 that step
runs gemm instead of gemv, r1's K/V at that position differ in every layer, the
next step's logits differ in their last bits, and a near-tie later flips.
Every value is deterministic, so screens can be snapshot-tested.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from divergence.core.events import (
    KernelChoice, KvWrite, RequestEvent, RunInfo, SeqSlice, StepEvent, StepPlan, TokenEvent,
)
from divergence.core.request import Request

WORDS = ["<s>", "</s>", "\n", "\t", " the", " number", " of", " items", " in", " a", " container", ".",
         " Return", " list", " sorted", " key", " function", " can", " be", " supplied", " to", " order",
         " and", " reverse", " flag", " set", " result", " is", " stable", " elements", " equal", " by",
         " object", " If", " The", " socket", " module", " provides", " access", " BSD", " interface",
         " Create", " new", " dictionary", " with", " keys", " from", " iterable", " values", ",", "(", ")",
         " x", " y", " 0", " 1", " None", " True", "ing", "ed", "s", " é", "ß", "->"]
OPS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
CREATED = "2026-01-01T00:00:00+00:00"


@dataclass(frozen=True)
class Story:
    """Where the story's events land (positions are sequence positions of r1)."""

    contaminating_step: int = 3  # B step: r2 prefill + r1 decode
    contaminated_position: int = 8  # r1's position written by that step
    numeric_position: int = 10  # first position whose logits differ
    flip_position: int = 14  # first divergent token


STORY = Story()


def requests(n_extra: int = 1, *, max_tokens: int = 24, long_prompt: int = 40) -> list[Request]:
    """r1 (short prompt), r2 (long prompt arriving at step 3), and n_extra later requests."""
    reqs = [Request("r1", (0, 12, 4, 5, 6, 7), max_tokens=max_tokens, arrival=0),
            Request("r2", tuple(12 + (i * 7) % 50 for i in range(long_prompt)), max_tokens=8, arrival=3)]
    for j in range(n_extra):
        reqs.append(Request(f"r{3 + j}", (0, 41, 42, 43), max_tokens=max_tokens // 2, arrival=5 + 2 * j))
    return reqs


def _h(*xs) -> int:
    return zlib.crc32(repr(xs).encode()) * 0x9E3779B1 % (2**63)


def _kernel(rows: int) -> tuple[str, int]:
    """threshold:4: rows <= 4 -> gemv, else gemm with a shape-dependent split-K."""
    if rows <= 4:
        return "gemv", 1
    return "gemm", 2 if rows < 16 else 4 if rows < 64 else 8


class _Run:
    """Generates one schedule's events and feeds them to a writer."""

    def __init__(self, writer, schedule: str, reqs, *, layers: int, top_k: int, vocab: int, story: Story | None,
                 weights_hash: str, duration: float):
        self.w, self.schedule, self.reqs = writer, schedule, reqs
        self.layers, self.top_k, self.vocab, self.story = layers, top_k, vocab, story
        self.weights_hash, self.duration = weights_hash, duration
        self.seqs = {r.id: list(r.prompt_tokens) for r in reqs}
        self.flipped = False

    def info(self) -> RunInfo:
        return RunInfo(schedule=self.schedule, policy="threshold:4",
                       settings={"policy": "threshold:4", "token_budget": 256, "spec_k": 0, "top_k": self.top_k,
                                 "dtype": "bfloat16"},
                       requests=self.reqs,
                       model={"path": "fixtures/target", "weights_hash": self.weights_hash, "dtype": "bfloat16",
                              "model_type": "llama", "num_layers": self.layers},
                       draft=None,
                       environment={"divergence": "0.1.0", "mlx": "0.32.4", "mlx_lm": "0.32.2", "python": "3.11.7",
                                    "backend": "cpu", "device": "Device(cpu, 0)", "blas": "netlib (bundled)"},
                       vocab=[WORDS[i % len(WORDS)] if i < len(WORDS) else f"<{i}>" for i in range(self.vocab)])

    def contaminated(self, rid: str, position: int, layer: int) -> bool:
        s = self.story
        if s is None or self.schedule != "concurrent" or rid != "r1":
            return False
        return position == s.contaminated_position or (position > s.contaminated_position and layer >= 1)

    def logits(self, rid: str, position: int) -> tuple[np.ndarray, np.ndarray, int]:
        """top-k ids / logits (float32) of the token at `position`, and the token chosen."""
        diverged = self.flipped and rid == "r1"
        rng = np.random.default_rng(_h(rid, position, "B" if diverged else "A"))
        ids = rng.choice(self.vocab, size=self.top_k, replace=False).astype(np.int32)
        top = np.float32(18 + 8 * rng.random())
        gaps = np.float32(10.0) ** rng.uniform(-4, 0.7, size=self.top_k - 1).astype(np.float32)
        vals = (top - np.concatenate([[0], np.cumsum(gaps)])).astype(np.float32)
        s = self.story
        if s is not None and rid == "r1" and position == s.flip_position and not diverged:
            vals[1] = np.nextafter(np.nextafter(vals[0], np.float32(0)), np.float32(0))  # a near-tie: 2 ulps
        if (s is not None and self.schedule == "concurrent" and rid == "r1" and not diverged
                and position >= s.numeric_position):
            bump = np.float32(np.spacing(vals) * rng.integers(1, 4, size=self.top_k))
            vals = (vals + np.where(rng.random(self.top_k) < 0.5, bump, -bump)).astype(np.float32)
            if position == s.flip_position:
                vals[1] = np.nextafter(max(vals[0], vals[1]), np.float32(100))  # the runner-up wins
                self.flipped = True
        order = np.argsort(-vals, kind="stable")
        return ids[order], vals[order], int(ids[order][0])

    def step(self, index: int, slices: list[tuple[str, str, int, int]]) -> list[str]:
        """slices: (request id, phase, start, count). Emits everything; returns the ids that finished."""
        plan_slices, row = [], 0
        for rid, phase, start, count in slices:
            toks = tuple(self.seqs[rid][start: start + count])
            plan_slices.append(SeqSlice(rid, phase, start, count, row, toks, (count - 1,)))
            row += count
        plan = StepPlan(index, "target", tuple(plan_slices))
        kernel, splits = _kernel(plan.rows)
        for layer in range(self.layers + 1):
            for op in OPS:
                if (op == "lm_head") != (layer == self.layers):
                    continue
                n = 512 if op == "lm_head" else 64
                self.w.on_kernel(KernelChoice(index, "target", layer, op, plan.rows, kernel, plan.rows, n, 64,
                                              splits))
        for s in plan_slices if self.w.wants_kv_hashes else ():
            for layer in range(self.layers):
                pos = range(s.start, s.start + s.count)
                k = [_h(s.request_id, layer, p, self.seqs[s.request_id][p], self.contaminated(s.request_id, p, layer),
                        "k") for p in pos]
                v = [_h(s.request_id, layer, p, self.seqs[s.request_id][p], self.contaminated(s.request_id, p, layer),
                        "v") for p in pos]
                self.w.on_kv_write(KvWrite(index, "target", s.request_id, layer, s.start, s.count,
                                           np.array(k, np.uint64), np.array(v, np.uint64)))
        done = []
        for s in plan_slices:
            rid = s.request_id
            position = s.start + s.count
            ids, vals, token = self.logits(rid, position)
            self.seqs[rid].append(token)
            self.w.on_token(TokenEvent(index, rid, position, token, 0, ids, vals))
            req = next(r for r in self.reqs if r.id == rid)
            if len(self.seqs[rid]) - len(req.prompt_tokens) >= req.max_tokens:
                done.append(rid)
                self.w.on_request(RequestEvent(index, rid, "finished", "length"))
        self.w.on_step(StepEvent(plan, self.duration * (1 + plan.rows / 16)))
        return done


def write_run(path, schedule: str, reqs=None, *, layers: int = 2, top_k: int = 4, vocab: int = 64,
              story: Story | None = STORY, weights_hash: str = "5eed000", duration: float = 0.002,
              kv_hashes: bool = True, stop_after: int | None = None):
    """Write one trace of `reqs` under `schedule` ("serial" or "concurrent"); with `stop_after`,
    the run is cut off after that many steps, as a killed run leaves its trace."""
    from divergence.trace.writer import TraceWriter

    reqs = requests() if reqs is None else reqs
    with TraceWriter(path, top_k=top_k, kv_hashes=kv_hashes) as w:
        run = _Run(w, schedule, reqs, layers=layers, top_k=top_k, vocab=vocab, story=story,
                   weights_hash=weights_hash, duration=duration)
        w.on_run_start(run.info())
        for r in reqs:
            w.on_request(RequestEvent(r.arrival, r.id, "arrived"))
        if stop_after is not None:
            run.step = _killed_after(run.step, stop_after)
        try:
            _schedule(run, schedule, reqs)
            w.on_run_end(True)
        except _Killed:
            w.close(completed=None)  # what a SIGKILL leaves: every flushed step, marked incomplete
    _freeze(path)
    return path


class _Killed(Exception):
    pass


def _killed_after(step, n: int):
    def step_or_die(index, slices):
        if index >= n:
            raise _Killed
        return step(index, slices)

    return step_or_die


def _schedule(run: "_Run", schedule: str, reqs) -> None:
    step = 0
    if schedule == "serial":
        for r in reqs:
            done = []
            while not done:
                n = len(run.seqs[r.id])
                sl = [(r.id, "prefill", 0, n)] if n == len(r.prompt_tokens) else [(r.id, "decode", n - 1, 1)]
                done = run.step(step, sl)
                step += 1
    else:
        active: list[Request] = []
        pending = sorted(reqs, key=lambda r: r.arrival)
        while pending or active:
            while pending and pending[0].arrival <= step:
                active.append(pending.pop(0))
            if not active:
                step += 1
                continue
            sl = []
            for r in active:
                n = len(run.seqs[r.id])
                sl.append((r.id, "prefill", 0, n) if n == len(r.prompt_tokens) else (r.id, "decode", n - 1, 1))
            sl.sort(key=lambda s: s[1] != "prefill")  # prefill rows first, as the engine packs them
            done = run.step(step, sl)
            active = [r for r in active if r.id not in done]
            step += 1


def _freeze(path) -> None:
    """A fixed creation time, so screens render the same every run."""
    import h5py

    with h5py.File(path, "r+") as f:
        f.attrs["created"] = CREATED


def write_pair(directory, **kw):
    """directory/serial.h5 and directory/concurrent.h5 of one story; returns both paths."""
    from pathlib import Path

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    return write_run(d / "serial.h5", "serial", **kw), write_run(d / "concurrent.h5", "concurrent", **kw)



def write_long(path, schedule: str, n_tokens: int, *, flip_at: int | None = None, top_k: int = 8,
               weights_hash: str = "10ng"):
    """One request generating `n_tokens` tokens, one decode step per token (a long serial run).

    Written in bulk through TraceWriter.append (the per-event path takes ~20 s for
    100k steps): two kernel records, one KV write and one token per step. From position
    `flip_at` on (if given) the logits move by one ulp and the tokens change, as in a
    diverged run; the KV write of the position before it differs too.
    """
    from divergence.trace import schema as S
    from divergence.trace.writer import TraceWriter

    vocab, n = 64, n_tokens
    prompt = (0, 12, 4, 5)
    P = len(prompt)
    req = Request("long", prompt, max_tokens=n)
    rng = np.random.default_rng(7)
    ids = np.argsort(rng.random((n, vocab)), axis=1)[:, :top_k].astype(np.int32)
    vals = np.sort(rng.uniform(15, 25, (n, top_k)).astype(np.float32), axis=1)[:, ::-1].copy()
    kv = rng.integers(0, 2**63, (n + P, 2), dtype=np.uint64)
    if flip_at is not None:
        g = flip_at - P
        vals[g:] = np.nextafter(vals[g:], np.float32(100))
        ids[g + 1:] = np.roll(ids[g + 1:], 1, axis=1)
        kv[flip_at - 1:] ^= np.uint64(1)
    steps = np.arange(n)
    rows = np.ones(n, np.int32)
    rows[0] = P
    start = np.r_[0, np.arange(P, P + n - 1)].astype(np.int32)
    with TraceWriter(path, top_k=top_k) as w:
        run = _Run(w, schedule, [req], layers=1, top_k=top_k, vocab=vocab, story=None, weights_hash=weights_hash,
                   duration=0.001)
        w.on_run_start(run.info())
        kern = np.repeat(steps, 2)
        krows = np.repeat(rows, 2)
        w.append("kernels", step=kern, model=0, layer=np.tile([0, 1], n),
                 op=np.tile([S.OPS.index("k_proj"), S.OPS.index("lm_head")], n), m=krows,
                 kernel=np.where(krows <= 4, S.KERNELS.index("gemv"), S.KERNELS.index("gemm")),
                 n=np.tile([64, 512], n), k=64, splits=np.where(krows <= 4, 1, 2), native_class=0)
        w.append("slices", step=steps, request=0,
                 phase=np.where(steps == 0, S.PHASES.index("prefill"), S.PHASES.index("decode")),
                 start=start, count=rows, row_offset=0, token_offset=np.r_[0, np.arange(P, P + n - 1)],
                 logit_offset=steps, logit_count=1)
        w.append("slice_tokens", value=np.r_[prompt, ids[:-1, 0]])
        w.append("slice_logit_rows", value=rows - 1)
        w.append("kv_hashes", k_hash=kv[:, 0], v_hash=kv[:, 1])
        w.append("kv_writes", step=steps, model=0, request=0, layer=0, start=start, count=rows,
                 hash_offset=start)
        w.append("tokens", step=steps, request=0, position=P + steps, token=ids[:, 0], spec=0, topk_ids=ids,
                 topk_logits=vals)
        w.append("steps", index=steps, model=0, duration=0.001, rows=rows, slice_offset=steps,
                 slice_count=1)
        w.on_request(RequestEvent(n - 1, "long", "finished", "length"))
        w.on_run_end(True)
    _freeze(path)
    return path
