"""One prompt run N times inside batches of varying size and composition.

The anchors' headline metric (Thinking Machines: 80 unique completions of 1000
identical requests; 1 with batch-invariant kernels; vLLM's "needle" test): how
many distinct completions does the same greedy request get, depending only on
what it was batched with, and where do they first differ?

All N copies (the needles) run in one continuous-batching stream with co-batched
traffic (the fillers), as a server would see them, not N runs one after another:
a run's fixed costs are paid once and a step carries several needles. The stream
is a sequence of segments; segment j keeps b_j lanes busy (b_j drawn from
1..max_batch), each lane a chain of requests back to back, each link a needle or
(where b_j > 1) a filler of random prompt and length. So the stream's steps are
spread evenly over the batch sizes, needles land in a batch of b in proportion to
b, and each needle meets others at other positions, prefills joining its decode
steps, fillers ending mid-way. Arrivals are planned with each request's length
(the needle's from its run alone, the fillers' from one probe run), so a step
holds at most max_batch requests as long as no request's length changes; the
batch size reported per needle is the largest number of requests of any step it
was in, as the run's step plans say.
"""
from __future__ import annotations

import heapq
import random
from collections import Counter
from dataclasses import dataclass, field, replace

from ..core.events import TARGET, Observer
from ..core.request import Request
from ..core.rules import at_least_one
from ..errors import PromptError

MAX_BATCH = 1024  # --max-batch above this is refused (one segment's lanes are planned at once)

FILLERS = [
    "Return the number of items in a container.",
    "Create a new dictionary with keys from iterable and values set to value.",
    "The socket module provides access to the BSD socket interface.",
    "Open file and return a stream. Raise OSError upon failure.",
    "Return a new sorted list from the items in iterable.",
    "This module provides regular expression matching operations similar to those found in Perl.",
    "Convert a number or string to an integer, or return 0 if no arguments are given.",
    "Decode the object using the codec registered for encoding.",
]

FILLER_SHARE = 0.1  # chance that a lane's next request is a filler (other needles are co-traffic too; rows cost time)
# a segment lasts 1..S needle lifetimes (drawn per segment), S <= SEGMENT_NEEDLES and small
# enough that a short sweep still spans about SEGMENTS segments (batch sizes) rather than one
SEGMENT_NEEDLES = 4
SEGMENTS = 16
# KV positions one engine.run may reserve (a run reserves every request's whole length at
# admission, all requests at once): a longer stream runs as several runs, split between segments
STREAM_TOKENS = 1 << 18


@dataclass
class SweepResult:
    prompt: str
    runs: int
    policy: str
    unique: int
    counts: list[int]  # runs per distinct completion, most common first
    first_difference: dict = field(default_factory=dict)  # generated index -> runs first differing there
    # per needle (run), in order: the most requests in one step it was in (itself included)
    batch_sizes: list[int] = field(default_factory=list)
    reference_tokens: list[int] = field(default_factory=list)
    completions: list[str] = field(default_factory=list)  # text of each distinct completion, by count
    diverge_at: list = field(default_factory=list)  # per completion: first generated index differing from alone
    tails: list[str] = field(default_factory=list)  # per completion: its text from just before that index
    fillers: int = 0  # co-batched requests of the stream
    steps: int = 0  # target steps of the stream (of all its engine runs)
    engine_runs: int = 0  # engine.run calls the stream took (1 unless it outgrew STREAM_TOKENS)

    def to_json(self) -> dict:
        return {"prompt": self.prompt, "runs": self.runs, "policy": self.policy, "unique_completions": self.unique,
                "counts": self.counts, "first_difference": {str(k): v for k, v in sorted(self.first_difference.items())},
                "batch_sizes": self.batch_sizes, "completions": self.completions, "diverge_at": self.diverge_at,
                "stream": {"fillers": self.fillers, "steps": self.steps, "engine_runs": self.engine_runs}}


def check_args(prompt: str, runs: int, max_batch: int, max_tokens: int) -> None:
    if runs < 1:
        raise PromptError("sweep needs at least one run (-n >= 1)")
    if not prompt:
        raise PromptError("sweep needs a non-empty --prompt")
    if not 1 <= max_batch <= MAX_BATCH:
        raise PromptError(f"--max-batch must be in 1..{MAX_BATCH}, got {max_batch}")
    at_least_one("max_tokens", max_tokens)


def sweep(engine, prompt: str, *, runs: int = 20, max_batch: int = 8, max_tokens: int = 48, seed: int = 0,
          progress=None) -> SweepResult:
    """Run `prompt` (greedy) `runs` times in one seeded stream of batches of 1..max_batch
    requests (see the module's docstring), under the engine's policy, concurrent schedule.
    progress(done, runs) is called as needles finish."""
    check_args(prompt, runs, max_batch, max_tokens)
    rng = random.Random(seed)
    needle = tuple(engine.encode(prompt))
    alone_run = engine.run([Request("needle", needle, max_tokens=max_tokens)], "concurrent")
    alone = alone_run.outputs["needle"].tokens
    fillers = filler_lengths(engine, max_tokens) if max_batch > 1 else []
    chunks = plan_stream(rng, runs, max_batch, needle, max(1, alone_run.target_steps), fillers, max_tokens).chunks
    watch = _Watch(runs, progress)
    engine.observers.append(watch)
    outs, steps = {}, 0
    try:
        for chunk in chunks:
            res = engine.run(chunk, "concurrent")
            outs.update((k, o) for k, o in res.outputs.items() if k.startswith("n"))
            steps += res.target_steps
    finally:
        engine.observers.remove(watch)
    seen: Counter = Counter()
    texts: dict[tuple, str] = {}
    first_diff: Counter = Counter()
    for i in range(runs):
        out = outs[f"n{i}"]
        key = tuple(out.tokens)
        seen[key] += 1
        texts[key] = out.text
        k = _first_diff(key, alone)
        if k is not None:
            first_diff[k] += 1
    ranked = seen.most_common()
    at = [_first_diff(k, alone) for k, _ in ranked]
    tails = [engine.decode(list(k)[max(0, (i or 0) - 4):]) for (k, _), i in zip(ranked, at)]
    n_fill = sum(len(c) for c in chunks) - runs
    return SweepResult(prompt, runs, str(engine.policy), len(seen), [c for _, c in ranked], dict(first_diff),
                       [watch.batch[f"n{i}"] for i in range(runs)], list(alone), [texts[k] for k, _ in ranked], at,
                       tails, n_fill, steps, len(chunks))


def filler_lengths(engine, max_tokens: int) -> list[tuple[tuple[int, ...], int]]:
    """(prompt tokens, tokens it generates up to max_tokens) of each filler, from one run of
    all of them together: the planner then knows when a filler's lane frees up."""
    prompts = [tuple(engine.encode(t)) for t in FILLERS]
    res = engine.run([Request(f"p{i}", p, max_tokens=max_tokens) for i, p in enumerate(prompts)], "concurrent")
    return [(p, max(1, len(res.outputs[f"p{i}"].tokens))) for i, p in enumerate(prompts)]


@dataclass
class Stream:
    """A planned stream: its requests, as chunks of one engine.run each (arrivals are engine
    steps from the chunk's start), and each chunk's segments (start, end, batch), likewise."""

    chunks: list[list[Request]]
    segments: list[list[tuple[int, int, int]]]


def plan_stream(rng: random.Random, runs: int, max_batch: int, needle: tuple[int, ...], needle_life: int,
                fillers: list, max_tokens: int) -> Stream:
    """needle_life: the steps a needle is in (its run alone's); fillers: (tokens, natural
    length) to draw from. Needles are n0..n{runs-1} in arrival order, fillers f0, f1, ...

    Lane k is busy in the segments whose batch is > k. A lane that stays busy from one
    segment into the next keeps its chain going (no idle steps at the boundary); a request
    ends before its lane's busy span does, so a step holds at most its segment's batch."""
    per_segment = (max_batch + 1) / 2 * (1 - FILLER_SHARE)  # needles a segment of one needle lifetime holds
    longest = max(1, min(SEGMENT_NEEDLES, int(2 * runs / (SEGMENTS * per_segment)) - 1))
    plan = _Segments(rng, max_batch, needle_life, longest)
    chunks: list[list[Request]] = []
    cur: list[Request] = []
    segs: list[list[tuple[int, int, int]]] = [[]]
    free: dict[int, int] = {}  # lane -> the step its chain is free from (lanes busy into this segment)
    made = nf = reserved = last = 0  # last: the step the latest planned request ends
    base = 0  # the current chunk's first step
    low = min(8, max_tokens)  # shortest filler drawn (as the per-run sweep drew them)
    j = 0
    while made < runs:
        start, end, b = plan.get(j)
        closing = reserved >= STREAM_TOKENS // 2  # this segment ends the chunk: no lane runs past it
        heap = []
        for k in range(b):
            t = free.get(k)
            if t is None:  # a lane joining: staggered (lane 0 at once: no idle step), so needles are at other positions
                t = start + (rng.randrange(needle_life) if k else 0)
            if t < end:
                heapq.heappush(heap, (t, k))
        free = {k: t for k, t in free.items() if k < b and t >= end}  # a request spans this whole segment
        seg: list[Request] = []
        while heap and made < runs:
            t, k = heapq.heappop(heap)
            until = end if closing else plan.busy_until(j, k, t + max(needle_life, max_tokens))
            if b > 1 and fillers and rng.random() < FILLER_SHARE:
                tokens, natural = rng.choice(fillers)
                n = min(rng.randint(low, max_tokens), until - t)  # a filler ends with its lane's busy span
                seg.append(Request(f"f{nf}", tokens, max_tokens=n, arrival=t))
                nf += 1
                t += min(n, natural)
                last = max(last, t)
            elif t + needle_life <= until:
                seg.append(Request(f"n{made}", needle, max_tokens=max_tokens, arrival=t))
                made += 1
                t += needle_life
                last = max(last, t)
            else:
                t = until  # no needle fits before the lane stops: it idles
            if t < end:
                heapq.heappush(heap, (t, k))
            else:
                free[k] = t  # the lane's next request (if it is still busy then) starts there
        for t, k in heap:
            free.setdefault(k, t)
        reserved += sum(len(r.prompt_tokens) + r.max_tokens + 1 for r in seg)
        cur += [replace(r, arrival=r.arrival - base) for r in seg]
        segs[-1].append((start - base, end - base, b))
        j += 1
        if closing or made == runs:
            while plan.get(j)[0] < last:  # segments this chunk's last requests run into
                start, end, b = plan.get(j)
                segs[-1].append((start - base, end - base, b))
                j += 1
            chunks.append(cur)
            segs.append([])
            cur, reserved, base, free = [], 0, plan.get(j)[0], {}
    return Stream([sorted(c, key=lambda r: (r.arrival, r.id)) for c in chunks], segs[:-1])


class _Segments:
    """The stream's segments, drawn as the planner reaches them: (start, end, batch)."""

    def __init__(self, rng: random.Random, max_batch: int, needle_life: int, longest: int):
        self.rng, self.max_batch, self.life, self.longest = rng, max_batch, needle_life, longest
        self.segs: list[tuple[int, int, int]] = []

    def get(self, j: int) -> tuple[int, int, int]:
        while len(self.segs) <= j:
            start = self.segs[-1][1] if self.segs else 0
            self.segs.append((start, start + self.life * self.rng.randint(1, self.longest),
                              self.rng.randint(1, self.max_batch)))
        return self.segs[j]

    def busy_until(self, j: int, lane: int, need: int) -> int:
        """The step lane `lane` stops being busy, from segment j on (looked up to `need`)."""
        end = self.get(j)[1]
        while end < need:
            j += 1
            start, nxt, b = self.get(j)
            if lane >= b:
                break
            end = nxt
        return end


class _Watch(Observer):
    """The batch each needle saw (most requests in one target step it was in) and progress."""

    def __init__(self, runs: int, progress):
        self.batch = {f"n{i}": 0 for i in range(runs)}
        self.progress = progress
        self.done = 0
        self.runs = runs

    def on_step(self, event) -> None:
        plan = event.plan
        if plan.model != TARGET:
            return
        n = len(plan.slices)
        for sl in plan.slices:
            if sl.request_id in self.batch and self.batch[sl.request_id] < n:
                self.batch[sl.request_id] = n

    def on_request(self, event) -> None:
        if event.kind == "finished" and event.request_id in self.batch:
            self.done += 1
            if self.progress:
                self.progress(self.done, self.runs)


def _first_diff(tokens, alone) -> int | None:
    if list(tokens) == list(alone):
        return None
    return next((n for n, (x, y) in enumerate(zip(tokens, alone)) if x != y), min(len(tokens), len(alone)))
