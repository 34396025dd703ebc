"""One prompt run N times inside batches of varying size and composition.

The anchors' headline metric (Thinking Machines: 80 unique completions of 1000
identical requests; 1 with batch-invariant kernels; vLLM's "needle" test): how
many distinct completions does the same greedy request get, depending only on
what it was batched with, and where do they first differ?
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

from ..core.request import Request
from ..core.rules import at_least_one
from ..errors import PromptError

MAX_BATCH = 1024  # --max-batch above this is refused (the fillers of one run are all in memory at once)

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


@dataclass
class SweepResult:
    prompt: str
    runs: int
    policy: str
    unique: int
    counts: list[int]  # runs per distinct completion, most common first
    first_difference: dict = field(default_factory=dict)  # generated index -> runs first differing there
    batch_sizes: list[int] = field(default_factory=list)
    reference_tokens: list[int] = field(default_factory=list)
    completions: list[str] = field(default_factory=list)  # text of each distinct completion, by count
    diverge_at: list = field(default_factory=list)  # per completion: first generated index differing from alone
    tails: list[str] = field(default_factory=list)  # per completion: its text from just before that index

    def to_json(self) -> dict:
        return {"prompt": self.prompt, "runs": self.runs, "policy": self.policy, "unique_completions": self.unique,
                "counts": self.counts, "first_difference": {str(k): v for k, v in sorted(self.first_difference.items())},
                "batch_sizes": self.batch_sizes, "completions": self.completions, "diverge_at": self.diverge_at}


def sweep(engine, prompt: str, *, runs: int = 20, max_batch: int = 8, max_tokens: int = 48, seed: int = 0,
          progress=None) -> SweepResult:
    """Run `prompt` (greedy) `runs` times, each in a seeded random batch of 1..max_batch
    requests with staggered arrivals, under the engine's policy, concurrent schedule."""
    if runs < 1:
        raise PromptError("sweep needs at least one run (-n >= 1)")
    if not prompt:
        raise PromptError("sweep needs a non-empty --prompt")
    if not 1 <= max_batch <= MAX_BATCH:
        raise PromptError(f"--max-batch must be in 1..{MAX_BATCH}, got {max_batch}")
    at_least_one("max_tokens", max_tokens)
    rng = random.Random(seed)
    needle = tuple(engine.encode(prompt))
    alone = engine.run([Request("needle", needle, max_tokens=max_tokens)], "concurrent").outputs["needle"].tokens
    seen: Counter = Counter()
    texts: dict[tuple, str] = {}
    first_diff: Counter = Counter()
    sizes = []
    for i in range(runs):
        b = rng.randint(1, max_batch)
        sizes.append(b)
        reqs = []
        for j in range(b - 1):
            text = rng.choice(FILLERS)
            n = rng.randint(min(8, max_tokens), max_tokens)  # (8.. as before; --max-tokens below 8 too)
            reqs.append(Request(f"f{j}", tuple(engine.encode(text)), max_tokens=n, arrival=rng.randint(0, 12)))
        reqs.insert(rng.randint(0, len(reqs)), Request("needle", needle, max_tokens=max_tokens,
                                                       arrival=rng.randint(0, 12)))
        out = engine.run(reqs, "concurrent").outputs["needle"]
        key = tuple(out.tokens)
        seen[key] += 1
        texts[key] = out.text
        k = _first_diff(key, alone)
        if k is not None:
            first_diff[k] += 1
        if progress:
            progress(i + 1, runs)
    ranked = seen.most_common()
    at = [_first_diff(k, alone) for k, _ in ranked]
    tails = [engine.decode(list(k)[max(0, (i or 0) - 4):]) for (k, _), i in zip(ranked, at)]
    return SweepResult(prompt, runs, str(engine.policy), len(seen), [c for _, c in ranked], dict(first_diff), sizes,
                       list(alone), [texts[k] for k, _ in ranked], at, tails)


def _first_diff(tokens, alone) -> int | None:
    if list(tokens) == list(alone):
        return None
    return next((n for n, (x, y) in enumerate(zip(tokens, alone)) if x != y), min(len(tokens), len(alone)))
