"""Faults: a client that leaves mid-stream, SIGKILL, SIGTERM with a request in flight, rotation."""
from __future__ import annotations

import json
import signal
import time

import httpx
import openai

from divergence.engine.model.loading import load_cached

from .conftest import TARGET, answer, divergence, trace_of

PROMPT = "def add(a, b):\n    "


def _kinds(t, rid: str) -> list[tuple[str, int]]:
    ev = t.table("request_events")
    i = t.request_index(rid)
    return [(str(k), int(s)) for k, s, r in zip(ev["kind"], ev["step"], ev["request"]) if int(r) == i]


def test_a_client_that_leaves_mid_stream_cancels_and_frees_its_blocks(serve):
    # 70 blocks of 16: the long request holds 63, so the second (10) is admitted only once they are free
    s = serve("--kv-blocks", "70", "--ignore-eos")
    body = {"model": "target", "prompt": PROMPT, "max_tokens": 1000, "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", s.base_url + "/completions", json=body) as r:
            long_id = r.headers["x-divergence-request-id"]
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]  # a few tokens, then hang up
            assert any(x.startswith("data: ") for x in got)
    t0 = time.monotonic()
    r = httpx.post(s.base_url + "/completions", json={"model": "target", "prompt": PROMPT, "max_tokens": 150},
                   timeout=120)
    assert r.status_code == 200 and time.monotonic() - t0 < 60
    short_id = r.json()["id"]
    [path] = s.traces()
    with trace_of(path) as t:
        long_ev, short_ev = _kinds(t, long_id), _kinds(t, short_id)
        assert [k for k, _ in long_ev] == ["arrived", "cancelled"], long_ev
        assert 0 < len(t.tokens(long_id).tokens) < 1000
        assert short_ev[0][0] == "arrived" and short_ev[0][1] >= long_ev[1][1]  # admitted once the blocks were free
    assert s.stop() == 0
    with trace_of(path) as t:
        assert t.completed and ("cancelled" in {k for k, _ in _kinds(t, long_id)})


def test_sigkill_leaves_a_trace_that_opens_with_every_finished_request(serve, tmp_path):
    s = serve()
    client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=120)
    answers = [client.completions.create(model="target", prompt=PROMPT * n, max_tokens=10) for n in (1, 2, 3)]
    s.stop(signal.SIGKILL)
    [path] = s.traces()
    model = load_cached(TARGET)
    with trace_of(path) as t:
        assert not t.completed
        assert [r.id for r in t.requests] == [a.id for a in answers]
        for a in answers:
            assert a.choices[0].text == answer(model, t.tokens(a.id).tokens.tolist())
    r = divergence("rerun", str(path), "--out", str(tmp_path / "ref"))
    assert r.returncode == 0, r.stderr
    d = divergence("diff", str(tmp_path / "ref" / "serial.h5"), str(path), "--json")
    assert d.returncode == 0, d.stdout + d.stderr
    assert json.loads(d.stdout)["identical"]


def test_sigterm_finishes_the_request_in_flight_and_closes_the_trace(serve):
    s = serve("--ignore-eos")
    body = {"model": "target", "prompt": PROMPT, "max_tokens": 200, "stream": True}
    with httpx.Client(timeout=120) as c:
        with c.stream("POST", s.base_url + "/completions", json=body) as r:
            rid = r.headers["x-divergence-request-id"]
            lines = r.iter_lines()
            next(lines)
            s.proc.send_signal(signal.SIGTERM)
            chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert s.proc.wait(60) == 0
    [path] = s.traces()
    with trace_of(path) as t:
        assert t.completed
        assert len(t.tokens(rid).tokens) == 200
        assert [k for k, _ in _kinds(t, rid)] == ["arrived", "finished"]


def test_rotation_starts_a_new_trace_and_the_response_names_it(serve):
    s = serve("--rotate-mb", "0.000001", "--ignore-eos")  # every segment is over the size once it holds a request
    named = []
    for n in range(3):
        r = httpx.post(s.base_url + "/completions", json={"model": "target", "prompt": PROMPT, "max_tokens": 3},
                       timeout=120)
        assert r.status_code == 200
        named.append((r.json()["id"], r.headers["x-divergence-trace"]))
    assert s.stop() == 0
    assert len({p for _, p in named}) == 3
    for rid, p in named:
        with trace_of(p) as t:
            assert t.completed and [q.id for q in t.requests] == [rid]
            assert len(t.tokens(rid).tokens) == 3
