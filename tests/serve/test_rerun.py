"""Real traffic, then `divergence rerun --schedule serial` and the pair's analysis: where batching
changes nothing (the CPU's native kernels) the serial tokens are the live ones; under threshold:4
(a GPU's shape-dependent GEMM) diff finds the divergence and bisect --confirm proves its step."""
from __future__ import annotations

import asyncio
import json
import time

import openai

from divergence.engine.model.loading import load_cached

from .conftest import DRAFT, TARGET, answer, divergence, trace_of

PROMPTS = ["def add(a, b):\n    ", "Return the number of", "class Stack:\n    \"\"\"", "import os\nimport",
           "The quick brown", "    for i in range(", "def __init__(self", "Raise ValueError if"]
CLIENTS, PER_CLIENT = 16, 4
LOAD_TIMEOUT_S = 300


async def _load(base_url: str, clients: int, per_client: int, max_tokens: int) -> list[tuple[str, str]]:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=LOAD_TIMEOUT_S)

    async def one(c: int) -> list[tuple[str, str]]:
        out = []
        for j in range(per_client):
            prompt = PROMPTS[(c + j) % len(PROMPTS)] * (1 + (c * per_client + j) % 3)  # mixed lengths
            if (c + j) % 2:
                r = await client.completions.create(model="target", prompt=prompt, max_tokens=max_tokens)
                out.append((r.id, r.choices[0].text))
            else:
                chunks = [ch async for ch in await client.completions.create(
                    model="target", prompt=prompt, max_tokens=max_tokens, stream=True)]
                out.append((chunks[0].id, "".join(ch.choices[0].text for ch in chunks)))
        return out

    try:
        got = await asyncio.wait_for(asyncio.gather(*(one(c) for c in range(clients))), LOAD_TIMEOUT_S)
    finally:
        await client.close()
    return [x for g in got for x in g]


def test_16_clients_each_answer_is_the_traces_and_serial_rerun_is_identical(serve, tmp_path):
    s = serve()
    t0 = time.monotonic()
    answers = asyncio.run(_load(s.base_url, CLIENTS, PER_CLIENT, max_tokens=12))
    assert time.monotonic() - t0 < LOAD_TIMEOUT_S
    assert len(answers) == CLIENTS * PER_CLIENT and len({a for a, _ in answers}) == len(answers)
    assert s.stop() == 0
    [live] = s.traces()
    model = load_cached(TARGET)
    with trace_of(live) as t:
        assert t.completed
        assert len(t.requests) == len(answers)
        for rid, text in answers:
            assert text == answer(model, t.tokens(rid).tokens.tolist()), rid
        batched = max(int(n) for n in t.steps["slice_count"])
    assert batched > 1  # the clients' requests really were batched together
    r = divergence("rerun", str(live), "--schedule", "serial", "--out", str(tmp_path / "ref"))
    assert r.returncode == 0, r.stderr
    ref = tmp_path / "ref" / "serial.h5"
    with trace_of(ref) as a, trace_of(live) as b:
        assert a.meta["schedule"] == "serial"
        for req in b.requests:  # greedy, batch-invariant kernels: batching changed no token
            assert a.tokens(req.id).tokens.tolist() == b.tokens(req.id).tokens.tolist(), req.id
    d = divergence("diff", str(ref), str(live), "--json")
    assert d.returncode == 0, d.stdout + d.stderr
    assert json.loads(d.stdout)["identical"] is True
    b = divergence("bisect", str(ref), str(live))
    assert b.returncode == 0, b.stdout + b.stderr


def test_threshold_traffic_diverges_and_bisect_confirms_the_step(serve, tmp_path):
    s = serve("--draft", str(DRAFT), "--policy", "threshold:4")
    answers = asyncio.run(_load(s.base_url, 8, 2, max_tokens=48))
    assert s.stop() == 0
    [live] = s.traces()
    r = divergence("rerun", str(live), "--out", str(tmp_path / "ref"))
    assert r.returncode == 0, r.stderr
    ref = tmp_path / "ref" / "serial.h5"
    d = divergence("diff", str(ref), str(live), "--json")
    assert d.returncode == 1, d.stdout + d.stderr
    report = json.loads(d.stdout)
    diverged = [q for q in report["requests"] if q["status"] == "diverged"]
    assert diverged and all(q["first_divergent_token"] for q in diverged)
    assert {q["id"] for q in report["requests"]} == {a for a, _ in answers}
    b = divergence("bisect", str(ref), str(live), "--confirm", "--json")
    assert b.returncode == 1, b.stdout[-2000:] + b.stderr
    causes = [q for q in json.loads(b.stdout)["requests"] if q["status"] == "diverged"]
    assert causes and any(q["root_cause"] and q["confirmed"] for q in causes), b.stdout[-3000:]
    for q in causes:
        if q["root_cause"] and q["confirmed"]:
            assert q["root_cause"]["step_b"] is not None
            assert q["root_cause"]["co_batched_b"]  # the concurrent traffic: another request in that step


def test_rerun_of_some_requests_and_bad_input(serve, tmp_path):
    s = serve()
    client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=120)
    ids = [client.completions.create(model="target", prompt=p, max_tokens=4).id for p in PROMPTS[:3]]
    assert s.stop() == 0
    [live] = s.traces()
    r = divergence("rerun", str(live), "--requests", ids[1], "--out", str(tmp_path / "one"))
    assert r.returncode == 0, r.stderr
    one = tmp_path / "one" / "serial.h5"
    with trace_of(one) as a, trace_of(live) as b:
        assert [q.id for q in a.requests] == [q.id for q in b.requests]  # comparable, request for request
        assert a.tokens(ids[1]).tokens.tolist() == b.tokens(ids[1]).tokens.tolist()
        assert len(a.tokens(ids[0]).tokens) == 0  # not re-run
        assert a.meta["settings"]["rerun"] == {"live": str(live), "requests": [ids[1]]}
    # what the command says diff will do, diff does: the re-run one compared (identical), the others left out
    note = [line for line in r.stdout.splitlines() if line.startswith("note:")]
    assert len(note) == 1 and "2 not re-run" in note[0] and ids[0] in note[0] and "left out" in note[0], r.stdout
    d = divergence("diff", str(one), str(live), "--json")
    assert d.returncode == 0, d.stdout + d.stderr
    status = {q["id"]: q["status"] for q in json.loads(d.stdout)["requests"]}
    assert status == {ids[1]: "identical"}
    assert divergence("bisect", str(live), str(one)).returncode == 0
    bad = divergence("rerun", str(live), "--requests", "cmpl-nope", "--out", str(tmp_path / "x"))
    assert bad.returncode == 2 and "cmpl-nope" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    notrace = tmp_path / "not.h5"
    notrace.write_text("hello")
    bad = divergence("rerun", str(notrace), "--out", str(tmp_path / "y"))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
