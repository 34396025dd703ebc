"""The OpenAI API against a running server (the official client and raw HTTP): completions and
chat, streaming and not; every answer is the trace's tokens for its request."""
from __future__ import annotations

import json
import math

import httpx
import pytest

from divergence.serve.text import chat_prompt

from .conftest import answer, openai_client, recorded, trace_of

PROMPT = "def add(a, b):\n    "
STOP_PROMPT = "The quick brown"  # 24 tokens of text before any end-of-text


@pytest.fixture(scope="module")
def client(demo_server):
    return openai_client(demo_server)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["target"]


def test_completion_is_the_traces_tokens(demo_server, client, model):
    r = client.completions.create(model="target", prompt=PROMPT, max_tokens=12, seed=5)
    prompt, tokens, kinds, req = recorded(demo_server, r.id)
    assert prompt == list(model.encode(PROMPT))
    assert len(tokens) == r.usage.completion_tokens and 0 < len(tokens) <= 12
    assert r.choices[0].text == answer(model, tokens)
    assert kinds == ["arrived", "finished"]
    assert (req.max_tokens, req.sampling.temperature, req.sampling.seed) == (12, 0.0, 5)


def test_the_response_names_its_request_in_a_header_too(demo_server):
    r = httpx.post(demo_server.base_url + "/completions", json={"model": "target", "prompt": PROMPT,
                                                                 "max_tokens": 3}, timeout=60)
    assert r.status_code == 200
    assert r.headers["x-divergence-request-id"] == r.json()["id"]
    assert r.headers["x-divergence-trace"] == str(demo_server.traces()[0])


def test_the_end_of_text_that_ends_a_request_is_counted_not_sent(demo_server, client, model):
    eos = set(model.tokenizer.eos_token_ids)
    for stream in (False, True):
        r = client.completions.create(model="target", prompt="Return the number of", max_tokens=48, stream=stream,
                                      **({"stream_options": {"include_usage": True}} if stream else {}))
        chunks = list(r) if stream else [r]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        _, tokens, _, _ = recorded(demo_server, chunks[0].id)
        assert len(tokens) < 48 and tokens[-1] in eos  # this prompt ends at end-of-text
        assert text == model.decode(tokens[:-1]) and model.decode(tokens[-1:]) not in text
        assert chunks[-1].usage.completion_tokens == len(tokens)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_streamed_completion_joins_to_the_traces_text(demo_server, client, model):
    chunks = list(client.completions.create(model="target", prompt=PROMPT, max_tokens=16, stream=True))
    text = "".join(c.choices[0].text for c in chunks)
    assert len({c.id for c in chunks}) == 1
    _, tokens, _, _ = recorded(demo_server, chunks[0].id)
    assert text == answer(model, tokens)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_chat_uses_the_template_and_is_the_traces_tokens(demo_server, client, model):
    messages = [{"role": "user", "content": "Return the sum."}]
    r = client.chat.completions.create(model="target", messages=messages, max_tokens=10)
    prompt, tokens, _, _ = recorded(demo_server, r.id)
    assert r.id.startswith("chatcmpl-")
    assert prompt == chat_prompt(model, messages)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == answer(model, tokens)


def test_streamed_chat(demo_server, client, model):
    stream = client.chat.completions.create(model="target", messages=[{"role": "user", "content": "Hello"}],
                                            max_tokens=10, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    _, tokens, _, _ = recorded(demo_server, chunks[0].id)
    assert text == answer(model, tokens)
    assert chunks[-1].usage.completion_tokens == len(tokens)


def test_logprobs_come_from_the_recorded_top_k(demo_server, client):
    r = client.completions.create(model="target", prompt=PROMPT, max_tokens=6, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    [path] = demo_server.traces()
    with trace_of(path) as t:
        rec = t.tokens(r.id)
    for i, top in enumerate(lp.top_logprobs):
        assert len(top) == 3
        assert lp.token_logprobs[i] <= 0
        # greedy: the chosen token is the top one, its logprob the largest
        assert max(top.values()) == pytest.approx(lp.token_logprobs[i])
        # the differences are the recorded logits' differences
        logits = rec.topk_logits[i][:3].astype(float)
        vals = sorted(top.values(), reverse=True)
        assert vals[0] - vals[1] == pytest.approx(logits[0] - logits[1], abs=1e-6)
    c = client.chat.completions.create(model="target", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=4, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens and all(len(x.top_logprobs) == 2 for x in content)
    assert all(math.isfinite(x.logprob) for x in content)


def test_stop_string_ends_the_text_and_the_request(demo_server, client, model):
    free = client.completions.create(model="target", prompt=STOP_PROMPT, max_tokens=24)
    text = free.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), text
    r = client.completions.create(model="target", prompt=STOP_PROMPT, max_tokens=24, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]
    _, tokens, kinds, _ = recorded(demo_server, r.id)
    assert kinds[-1] == "finished" and len(tokens) < 24  # the engine stopped too, not only the text


def test_sampled_requests_record_their_seed(demo_server, client):
    r = client.completions.create(model="target", prompt=PROMPT, max_tokens=8, temperature=0.8, top_p=0.9, seed=11)
    _, tokens, _, req = recorded(demo_server, r.id)
    assert (req.sampling.temperature, req.sampling.top_p, req.sampling.seed) == (0.8, 0.9, 11)
    unseeded = client.completions.create(model="target", prompt=PROMPT, max_tokens=2, temperature=0.5)
    assert recorded(demo_server, unseeded.id)[3].sampling.seed >= 0  # one was chosen and recorded


def test_the_live_trace_records_what_run_records(demo_server, client):
    # a prompt that decodes past one token (PROMPT may end at EOS at once: no draft round then,
    # and the draft steps seen would be other tests' requests, in whatever order they ran)
    r = client.completions.create(model="target", prompt="Return the number of", max_tokens=8)
    assert r.usage.completion_tokens > 1
    [path] = demo_server.traces()
    with trace_of(path) as t:
        idx = t.request_index(r.id)
        assert t.meta["schedule"] == "concurrent" and t.meta["settings"]["serve"]["spec"] == "fixed"
        assert (t.kv_writes()["request"] == idx).any()  # KV hashes, kernels, draft steps: as run records them
        assert len(t.kernels()["kernel"]) > 0
        assert "draft" in set(t.codes("models")[int(m)] for m in t.steps["model"])


def test_text_offset_is_where_each_token_starts_in_the_text(demo_server, client, model):
    r = client.completions.create(model="target", prompt=PROMPT, max_tokens=10, logprobs=1)
    text, lp = r.choices[0].text, r.choices[0].logprobs
    _, tokens, _, _ = recorded(demo_server, r.id)
    offsets = lp.text_offset
    assert len(offsets) == len(tokens) == len(lp.tokens)
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(text)
    for i, off in enumerate(offsets):  # the text before token i is the text of tokens 0..i-1
        assert text[:off] == answer(model, tokens[:i])
    # streamed (raw SSE): the chunks' offsets count in the text of all chunks joined, as one response's
    with httpx.stream("POST", demo_server.base_url + "/completions", timeout=120, json={
            "model": "target", "prompt": PROMPT, "max_tokens": 10, "logprobs": 1, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    streamed = [o for e in events for c in e["choices"] if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert "".join(c["text"] for e in events for c in e["choices"]) == text
    assert streamed == offsets


def test_text_offset_stops_at_a_stop_strings_cut(demo_server, client):
    free = client.completions.create(model="target", prompt=STOP_PROMPT, max_tokens=24)
    text = free.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    r = client.completions.create(model="target", prompt=STOP_PROMPT, max_tokens=24, stop=[stop], logprobs=0)
    cut = r.choices[0].text
    offsets = r.choices[0].logprobs.text_offset
    assert offsets == sorted(offsets) and offsets[-1] <= len(cut) and len(offsets) >= 1
