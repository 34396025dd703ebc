"""`divergence serve --engine mlx-lm`: the same API from mlx-lm's own BatchGenerator, the live
trace of mlx-lm's engine (read by divergence's readers, re-run by mlx-lm, diffed, replayed)."""
from __future__ import annotations

import asyncio
import json
import signal

import httpx
import openai
import pytest

from divergence.core.names import BATCH_GENERATOR
from divergence.serve.text import chat_prompt

from .conftest import TARGET, answer, divergence, openai_client, recorded, start_server, trace_of

PROMPTS = ["Raise ValueError if", "Return the number of", "class Stack:\n    \"\"\"", "import os\nimport",
           "The quick brown", "    for i in range(", "def add(a, b):\n    ", "# Copyright"]


@pytest.fixture(scope="module")
def mlx_server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("serve-mlxlm"), "--engine", "mlx-lm")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(mlx_server):
    return openai_client(mlx_server)


def test_the_live_trace_is_mlx_lms_engine(mlx_server, client):
    r = client.completions.create(model="target", prompt=PROMPTS[0], max_tokens=8)
    [path] = mlx_server.traces()
    with trace_of(path) as t:
        s = t.meta["settings"]
        assert (s["engine"], s["topk_values"], s["serve"]["engine"]) == (BATCH_GENERATOR, "logprobs", "mlx-lm")
        assert t.meta["schedule"] == "concurrent"
        assert (t.kv_writes()["request"] == t.request_index(r.id)).any()


def test_completions_and_chat_are_the_traces_tokens(mlx_server, client, model):
    r = client.completions.create(model="target", prompt=PROMPTS[1], max_tokens=12, logprobs=2)
    prompt, tokens, _, _ = recorded(mlx_server, r.id)
    assert prompt == list(model.encode(PROMPTS[1]))
    assert r.choices[0].text == answer(model, tokens) and r.usage.completion_tokens == len(tokens)
    assert len(r.choices[0].logprobs.text_offset) == len(tokens)
    assert all(v <= 0 for v in r.choices[0].logprobs.token_logprobs)  # mlx-lm's log-probs, as recorded
    messages = [{"role": "user", "content": "Return the sum."}]
    c = client.chat.completions.create(model="target", messages=messages, max_tokens=10)
    prompt, tokens, _, _ = recorded(mlx_server, c.id)
    assert prompt == chat_prompt(model, messages)
    assert c.choices[0].message.content == answer(model, tokens)


def test_streamed_completions_and_chat_are_the_traces_tokens(mlx_server, client, model):
    chunks = list(client.completions.create(model="target", prompt=PROMPTS[2], max_tokens=16, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == answer(model, recorded(mlx_server, chunks[0].id)[1])
    with httpx.stream("POST", mlx_server.base_url + "/chat/completions", timeout=120, json={
            "model": "target", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 10,
            "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert text == answer(model, recorded(mlx_server, events[0]["id"])[1])


def test_concurrent_clients_are_batched_and_each_is_its_trace(mlx_server, model):
    async def main():
        async with openai.AsyncOpenAI(base_url=mlx_server.base_url, api_key="unused", max_retries=0) as c:
            return await asyncio.gather(*(c.completions.create(model="target", prompt=p, max_tokens=24)
                                          for p in PROMPTS * 2))
    answers = asyncio.run(main())
    for r in answers:
        assert r.choices[0].text == answer(model, recorded(mlx_server, r.id)[1]), r.id
    [path] = mlx_server.traces()
    with trace_of(path) as t:  # some step held several of them: BatchGenerator batched the traffic
        assert max(t.steps["slice_count"]) >= 2


def test_a_bad_request_is_refused_and_nothing_recorded(mlx_server):
    r = httpx.post(mlx_server.base_url + "/completions", json={"model": "target", "prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_rerun_is_mlx_lm_serially_and_diffs_with_the_live_trace(tmp_path, model):
    s = start_server(tmp_path, "--engine", "mlx-lm")
    try:
        async def main():
            async with openai.AsyncOpenAI(base_url=s.base_url, api_key="unused", max_retries=0) as c:
                return await asyncio.gather(
                    *(c.completions.create(model="target", prompt=p, max_tokens=16) for p in PROMPTS[:5]),
                    c.completions.create(model="target", prompt=PROMPTS[5], max_tokens=8, temperature=0.9))
        answers = asyncio.run(main())
    finally:
        assert s.stop() == 0
    [live] = s.traces()
    out = tmp_path / "rerun"
    got = divergence("rerun", str(live), "--out", str(out))
    assert got.returncode == 0, got.stderr
    assert "5 requests" in got.stdout and f"left out {answers[-1].id}: sampled" in got.stderr
    with trace_of(out / "serial.h5") as t:
        assert t.meta["settings"]["engine"] == BATCH_GENERATOR and t.meta["schedule"] == "serial"
        for r in answers[:5]:
            assert answer(model, t.tokens(r.id).tokens.tolist()) == r.choices[0].text
    d = divergence("diff", str(out / "serial.h5"), str(live), "--json")
    assert d.returncode == 0, d.stdout + d.stderr  # this CPU's kernels: batching changes nothing
    report = json.loads(d.stdout)
    assert report["identical"] and len(report["requests"]) == 5
    conc = divergence("rerun", str(live), "--schedule", "concurrent", "--out", str(tmp_path / "c"))
    assert conc.returncode == 2 and len(conc.stderr.strip().splitlines()) == 1
    assert "re-runs serially" in conc.stderr


def test_engine_flags_it_cannot_take_are_one_line(tmp_path):
    got = divergence("serve", "--engine", "mlx-lm", "--draft", str(TARGET), "--trace-dir", str(tmp_path / "t"),
                     "--port", "0")
    assert got.returncode == 2 and len(got.stderr.strip().splitlines()) == 1
    assert "--engine mlx-lm takes no --draft" in got.stderr


def _kinds(t, rid: str) -> list[str]:
    ev = t.table("request_events")
    i = t.request_index(rid)
    return [str(k) for k, r in zip(ev["kind"], ev["request"]) if int(r) == i]


def test_faults_a_client_gone_is_cancelled_and_sigkill_keeps_the_answered(serve, model):
    s = serve("--engine", "mlx-lm", "--ignore-eos")
    body = {"model": "target", "prompt": PROMPTS[0], "max_tokens": 1000, "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", s.base_url + "/completions", json=body) as r:
            gone = r.headers["x-divergence-request-id"]
            lines = r.iter_lines()
            [next(lines) for _ in range(6)]  # a few tokens, then hang up
    client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=120)
    answers = [client.completions.create(model="target", prompt=p, max_tokens=10) for p in PROMPTS[1:3]]
    s.stop(signal.SIGKILL)
    [path] = s.traces()
    with trace_of(path) as t:
        assert not t.completed
        assert _kinds(t, gone) == ["arrived", "cancelled"] and 0 < len(t.tokens(gone).tokens) < 1000
        for a in answers:
            assert _kinds(t, a.id) == ["arrived", "finished"]
            assert a.choices[0].text == answer(model, t.tokens(a.id).tokens.tolist())


def test_replay_re_executes_the_live_mlx_lm_trace_bit_for_bit(serve):
    s = serve("--engine", "mlx-lm")

    async def main():
        async with openai.AsyncOpenAI(base_url=s.base_url, api_key="unused", max_retries=0) as c:
            return await asyncio.gather(*(c.completions.create(model="target", prompt=p, max_tokens=16)
                                          for p in PROMPTS[:6]))
    asyncio.run(main())
    assert s.stop() == 0
    [live] = s.traces()
    got = divergence("replay", str(live), "--json")  # divergence's engine stands in for BatchGenerator
    assert got.returncode == 0, got.stderr
    r = json.loads(got.stdout)
    assert (r["faithful"], r["tokens_equal"], r["logits_equal"], r["kv_equal"]) == (True, True, True, True)
