"""Bad requests are HTTP 400 with an OpenAI error body; the server keeps serving and records
nothing of them."""
from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import trace_of

OK = {"model": "target", "prompt": "def f(x):", "max_tokens": 2}


def _requests_recorded(server) -> int:
    [path] = server.traces()
    with trace_of(path) as t:
        return len(t.requests)


@pytest.mark.parametrize("path, body, param", [
    ("/completions", {**OK, "model": "gpt-4"}, "model"),
    ("/completions", {**OK, "max_tokens": "two"}, "max_tokens"),
    ("/completions", {**OK, "max_tokens": 0}, "max_tokens"),
    ("/completions", {**OK, "max_tokens": -3}, "max_tokens"),
    ("/completions", {**OK, "temperature": -0.5}, "temperature"),
    ("/completions", {**OK, "temperature": "hot"}, "temperature"),
    ("/completions", {**OK, "top_p": 0}, "top_p"),
    ("/completions", {**OK, "prompt": 42}, "prompt"),
    ("/completions", {**OK, "prompt": "x " * 3000}, "prompt"),  # longer than the 2,048-token context
    ("/completions", {**OK, "max_tokens": 5000}, "prompt"),
    ("/completions", {**OK, "stream": "yes"}, "stream"),
    ("/completions", {**OK, "logprobs": 99}, "logprobs"),
    ("/completions", {**OK, "n": 2}, "n"),
    ("/chat/completions", {"model": "target", "messages": "hi"}, "messages"),
    ("/chat/completions", {"model": "target", "messages": [{"role": "user", "content": 3}]}, "messages"),
    ("/completions", {"prompt": "x"}, "model"),
])
def test_bad_request_is_400_and_not_recorded(demo_server, path, body, param):
    before = _requests_recorded(demo_server)
    r = httpx.post(demo_server.base_url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    ok = httpx.post(demo_server.base_url + "/completions", json=OK, timeout=60)  # still serving
    assert ok.status_code == 200
    assert _requests_recorded(demo_server) == before + 1  # the good one only


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b"\xff\xfe"])
def test_a_body_that_is_not_a_json_object_is_400(demo_server, raw):
    r = httpx.post(demo_server.base_url + "/completions", content=raw,
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["code"] in ("invalid_json", "invalid_body")


def test_the_openai_client_sees_a_bad_request_error(demo_server):
    client = openai.OpenAI(base_url=demo_server.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert e.value.status_code == 400 and "nope" in str(e.value)
