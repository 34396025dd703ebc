"""The pieces without a server: request parsing, detokenizing with stop strings, and the
live requests table of a trace (written after the run started, read back like /requests)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from divergence.core.events import RequestEvent, RunInfo, SeqSlice, StepEvent, StepPlan, TokenEvent
from divergence.core.request import Request, Sampling
from divergence.serve.openai_schema import CHAT, COMPLETION, ApiError, parse
from divergence.serve.text import Detokenizer
from divergence.trace.reader import Trace
from divergence.trace.writer import TraceWriter


def _parse(body, kind=COMPLETION):
    return parse(body, kind, model_ids=("m",), top_k=8)


def test_parse_takes_what_the_engine_does():
    p = _parse({"model": "m", "prompt": ["hello"], "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "seed": 3,
                "stop": "\n", "logprobs": 2, "stream": True, "stream_options": {"include_usage": True}})
    assert (p.prompt, p.max_tokens, p.sampling, p.stop, p.logprobs, p.stream, p.include_usage) == \
        ("hello", 5, Sampling(0.5, 0.9, 3), ["\n"], 2, True, True)
    c = _parse({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                "max_completion_tokens": 7, "logprobs": True, "top_logprobs": 3}, CHAT)
    assert (c.messages, c.max_tokens, c.logprobs) == ([{"role": "user", "content": "hi"}], 7, 3)
    assert _parse({"model": "m", "prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    assert _parse({"model": "m", "prompt": "x"}).sampling.temperature == 0.0  # mlx_lm.server's default


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"model": "m", "prompt": "x", "seed": 1.5}, "seed"),
    ({"model": "m", "prompt": "x", "stop": ["a", ""]}, "stop"),
    ({"model": "m", "prompt": "x", "stop": ["a"] * 5}, "stop"),
    ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "m", "prompt": "x", "top_p": 1.5}, "top_p"),
    ({"model": "m", "prompt": "x", "echo": True}, "echo"),
])
def test_parse_refuses(body, param):
    with pytest.raises(ApiError) as e:
        _parse(body)
    assert e.value.param == param and e.value.status == 400 and e.value.body()["error"]["message"]


def test_detokenizer_holds_back_a_possible_stop_and_cuts_at_it():
    pieces = {1: "ab", 2: "c", 3: "END", 4: "xyz"}
    d = Detokenizer(lambda toks: "".join(pieces[t] for t in toks), stops=["END"])
    out = [d.add(t) for t in (1, 2, 3, 4)]
    assert "".join(out) == "abc" and d.stopped and d.text == "abc"
    d = Detokenizer(lambda toks: "".join(pieces[t] for t in toks))
    assert "".join(d.add(t) for t in (1, 2, 4)) + d.rest() == "abcxyz"
    half = Detokenizer(lambda toks: "\ufffd" if len(toks) == 1 else "é")  # one character in two tokens
    assert half.add(1) == "" and half.add(2) == "é"  # the partial character waits for its second byte


def _token(step, rid, pos, tok):
    return TokenEvent(step, rid, pos, tok, 0, np.array([tok, 1], np.int32), np.array([2.0, 1.0], np.float32),
                      logit=2.0, prob=0.7)


def test_live_requests_are_read_back_with_the_trace_open_and_after(tmp_path):
    path = tmp_path / "live.h5"
    w = TraceWriter(path, top_k=2, kv_hashes=False, background=False)
    w.on_run_start(RunInfo(schedule="concurrent", policy="native", settings={"top_k": 2}, requests=(),
                           model={"path": "/m", "weights_hash": "h", "dtype": "float32"}, vocab=["a", "b", "c"]))
    reqs = [Request("cmpl-1", (1, 2), max_tokens=3, arrival=0, sampling=Sampling(0.0, 1.0, 9)),
            Request("cmpl-2", (2,), max_tokens=2, arrival=1, sampling=Sampling(0.7, 0.9, 4))]
    w.on_request_added(reqs[0])
    w.on_request(RequestEvent(0, "cmpl-1", "arrived"))
    w.on_token(_token(0, "cmpl-1", 2, 1))
    w.on_step(StepEvent(StepPlan(0, "target", (SeqSlice("cmpl-1", "prefill", 0, 2, 0, (1, 2), (1,)),)), 0.01))
    w.on_request_added(reqs[1])
    w.on_request(RequestEvent(1, "cmpl-2", "arrived"))
    w.on_token(_token(1, "cmpl-2", 1, 0))
    w.on_request(RequestEvent(1, "cmpl-2", "cancelled"))
    w.on_step(StepEvent(StepPlan(1, "target", (SeqSlice("cmpl-2", "prefill", 0, 1, 0, (2,), (0,)),)), 0.01))
    w.flush()
    with pytest.raises(ValueError):
        w.on_request_added(reqs[0])  # one id, one row
    with Trace.open(path) as t:  # still being written
        assert not t.completed
        got = [(r.id, r.prompt_tokens, r.arrival, r.max_tokens, r.sampling) for r in t.requests]
        assert got == [(r.id, r.prompt_tokens, r.arrival, r.max_tokens, r.sampling) for r in reqs]
        assert t.tokens("cmpl-2").tokens.tolist() == [0]
    w.close(completed=True)
    with Trace.open(path) as t:
        t.check()
        assert t.completed and [r.id for r in t.requests] == ["cmpl-1", "cmpl-2"]
        ev = t.table("request_events")
        assert list(ev["kind"]) == ["arrived", "arrived", "cancelled"]
        assert [dataclasses.astuple(r.sampling) for r in t.requests] == [(0.0, 1.0, 9), (0.7, 0.9, 4)]
