"""The sparse replay on a live server's trace (requests joining while the run ran, greedy and
sampled, speculative decoding, threshold:4): for the request it proves, the sparse replay
gives the full replay's tokens, top-k logits, K/V hashes and draws (the other kinds of
trace: tests/analysis/test_sparse_replay.py)."""
from __future__ import annotations

import asyncio

import openai

from analysis.sparse_check import assert_sparse_is_full

from .conftest import DRAFT

PROMPTS = ["def add(a, b):\n    ", "Return the number of", "class Stack:\n    \"\"\"", "import os\nimport",
           "The quick brown", "    for i in range(", "def __init__(self", "Raise ValueError if"]


async def _traffic(base_url: str) -> None:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)

    async def one(i: int):
        extra = {"temperature": 0.8, "seed": 100 + i} if i % 2 else {}
        await asyncio.sleep(0.05 * i)  # joining while the others run
        await client.completions.create(model="target", prompt=PROMPTS[i] * (1 + i % 3), max_tokens=10, **extra)

    try:
        await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
    finally:
        await client.close()


def test_a_live_traces_sparse_replay_gives_the_full_replays_bits(serve):
    s = serve("--draft", str(DRAFT), "--policy", "threshold:4")
    asyncio.run(_traffic(s.base_url))
    assert s.stop() == 0
    [live] = s.traces()
    assert_sparse_is_full(live)
