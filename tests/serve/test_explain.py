"""`divergence explain` end to end: a server the test starts (the demo's settings: the fixture
draft, spec k=3, threshold:4, so batching changes the kernels), clients sending concurrent
traffic, the id a response carried, and explain naming and confirming the cause while the
server still writes the trace; the request found in a rotation sibling of the file named; a
tampered re-run refused; a killed server's trace explained; bad input one line, exit 2."""
from __future__ import annotations

import asyncio
import json
import shutil
import signal

import httpx
import pytest

from divergence.cli.main import main

from .conftest import DRAFT, divergence, start_server, trace_of

PROMPTS = ["def add(a, b):\n    ", "Return the number of", "class Stack:\n    \"\"\"", "import os\nimport",
           "The quick brown", "    for i in range(", "def __init__(self", "Raise ValueError if"]
CLIENTS, MAX_TOKENS = 8, 48


async def _traffic(base_url: str) -> list[dict]:
    """CLIENTS concurrent requests (completions, streamed completions, chat): each response's
    id as its body (or first chunk) carried it, its headers, and its text."""
    async with httpx.AsyncClient(timeout=300) as c:
        async def one(i: int) -> dict:
            prompt = PROMPTS[i % len(PROMPTS)] * (1 + i % 3)
            if i % 4 == 3:
                r = await c.post(base_url + "/chat/completions", json={
                    "model": "target", "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS})
                body = r.json()
                return {"id": body["id"], "headers": r.headers, "text": body["choices"][0]["message"]["content"]}
            if i % 2:
                async with c.stream("POST", base_url + "/completions", json={
                        "model": "target", "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True}) as r:
                    chunks = [json.loads(line[6:]) async for line in r.aiter_lines()
                              if line.startswith("data: ") and line != "data: [DONE]"]
                return {"id": chunks[0]["id"], "headers": r.headers,
                        "text": "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"])}
            r = await c.post(base_url + "/completions", json={"model": "target", "prompt": prompt,
                                                               "max_tokens": MAX_TOKENS})
            body = r.json()
            return {"id": body["id"], "headers": r.headers, "text": body["choices"][0]["text"]}

        return list(await asyncio.gather(*(one(i) for i in range(CLIENTS))))


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """A server that rotates its trace as soon as a segment has taken a request (the requests
    waiting meanwhile start the next segment together); one wave of traffic. Yields (server,
    responses, the id of a request that diverged from its serial re-run, its trace)."""
    tmp = tmp_path_factory.mktemp("explain")
    s = start_server(tmp, "--draft", str(DRAFT), "--policy", "threshold:4", "--rotate-minutes", "0.001")
    try:
        responses = asyncio.run(_traffic(s.base_url))
        for r in responses:  # the id a response carries is the request's id in the trace it names
            assert r["headers"]["x-divergence-request-id"] == r["id"]
            with trace_of(r["headers"]["x-divergence-trace"]) as t:
                assert len(t.tokens(r["id"]).tokens) > 0
        # which request diverged: the whole segment re-run, and diffed (explain re-runs one)
        busiest = max({r["headers"]["x-divergence-trace"] for r in responses},
                      key=lambda p: sum(r["headers"]["x-divergence-trace"] == p for r in responses))
        ref = tmp / "ref"
        got = divergence("rerun", busiest, "--out", str(ref))
        assert got.returncode == 0, got.stderr
        d = divergence("diff", str(ref / "serial.h5"), busiest, "--json")
        diverged = [q["id"] for q in json.loads(d.stdout)["requests"]
                    if q["status"] == "diverged" and q["first_divergent_token"]]
        assert diverged, d.stdout  # batching changed the kernels: some request's text flipped
        yield s, responses, diverged[0], busiest, tmp
    finally:
        if s.proc.poll() is None:
            s.stop()


def test_explain_names_and_confirms_the_cause_while_the_server_writes(live):
    s, responses, rid, trace, tmp = live
    assert s.proc.poll() is None  # still serving: the trace is being written (SWMR)
    # rotated: once the wave's segment drained, the next one opened; name a file the request is not in
    other = next(p for p in s.traces() if str(p) != trace)
    page = tmp / "explain.html"
    r = divergence("explain", str(other), rid, "--json", "--html", str(page))
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr
    out = json.loads(r.stdout)
    assert out["explain"]["live"] == trace and out["explain"]["requests"] == [rid]
    assert out["b"] == trace and out["selected"] == [rid]
    [req] = out["requests"]  # bisect --json's keys, for the request named only
    assert req["id"] == rid and req["status"] == "diverged" and req["first_divergent_token"]
    cause = req["root_cause"]
    assert cause["kind"] in ("cache_contamination", "step_compute"), cause
    assert cause["co_batched_b"], cause  # the concurrent traffic: other requests in that step
    assert req["confirmed"] is True, cause["confirm_detail"]
    assert cause["confirm_detail"].startswith("replaying concurrent"), cause["confirm_detail"]
    assert f"found in {trace}" in r.stderr
    assert rid in page.read_text()
    # the same report as text
    text = divergence("explain", trace, rid)
    assert text.returncode == 1, text.stderr
    assert f"{rid}  first divergent token" in text.stdout and "confirmed: replaying concurrent" in text.stdout


def test_a_tampered_rerun_is_refused(live, capsys, monkeypatch):
    """explain's confirmation checks each re-run of B: one that replays the serial re-run (A)
    instead of the live trace is not a re-run of B with only the forced change."""
    from divergence.analysis.replayer import Replayer
    from divergence.trace.reader import Trace

    _, _, rid, trace, tmp = live
    kept = tmp / "kept"
    real = Replayer.run
    swapped = []

    def run(self, t, *, forced=None, **kw):
        if t.meta["schedule"] == "concurrent" and forced:  # a forced replay of B: replay A instead
            with Trace.open(kept / "serial.h5") as a:
                swapped.append(forced)
                return real(self, a, **kw)
        return real(self, t, forced=forced, **kw)

    monkeypatch.setattr(Replayer, "run", run)
    capsys.readouterr()
    assert main(["explain", trace, rid, "--json", "--out", str(kept)]) == 1
    req = json.loads(capsys.readouterr().out)["requests"][0]
    assert swapped, "no forced replay ran"
    assert req["confirmed"] is False
    detail = req["root_cause"]["confirm_detail"]
    assert detail.startswith("not a valid re-run of concurrent: its schedule is serial"), detail
    assert (kept / "serial.h5").exists()  # --out keeps the re-run


def test_bad_input_is_one_line(live, tmp_path):
    s, responses, rid, trace, tmp = live

    def refused(*args) -> str:
        r = divergence("explain", *args)
        assert r.returncode == 2, r.stdout + r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
        return lines[0]

    assert "no request 'cmpl-999999'" in refused(trace, "cmpl-999999")
    assert "is not a live trace" in refused(str(tmp / "ref" / "serial.h5"), rid)  # a run's trace, not serve's
    junk = tmp_path / "junk.h5"
    junk.write_text("not a trace")
    assert "not an HDF5 file" in refused(str(junk), rid)
    # two servers on one directory: the id is in both files, and only the response's header says which
    other = tmp_path / "dir"
    other.mkdir()
    shutil.copy(trace, other / "live-1.h5")
    shutil.copy(trace, other / "live-2.h5")
    assert "is in 2 traces" in refused(str(other), rid)
    files = {r["headers"]["x-divergence-trace"] for r in responses}
    if len(files) > 1:  # requests of two segments in one call
        a = next(r["id"] for r in responses if r["headers"]["x-divergence-trace"] != trace)
        assert "different trace files" in refused(trace, rid, a)


def test_a_killed_servers_trace_is_explained(serve):
    """SIGKILL while a long request still runs: the answered requests are on disk, the trace
    is not completed, and explain takes it."""
    s = serve()
    body = {"model": "target", "prompt": PROMPTS[0], "max_tokens": 2000, "stream": True}

    async def wave():
        async with httpx.AsyncClient(timeout=300) as c:
            async with c.stream("POST", s.base_url + "/completions", json=body) as long:
                lines = long.aiter_lines()
                await anext(lines)  # the long request runs
                short = await asyncio.gather(*(c.post(s.base_url + "/completions", json={
                    "model": "target", "prompt": p, "max_tokens": 8}) for p in PROMPTS[1:4]))
                s.stop(signal.SIGKILL)
                return [r.json()["id"] for r in short], short[0].headers["x-divergence-trace"]

    ids, path = asyncio.run(_expect_disconnect(wave()))
    with trace_of(path) as t:
        assert not t.completed
    r = divergence("explain", path, ids[0], "--json")
    assert r.returncode in (0, 1), r.stderr
    out = json.loads(r.stdout)
    [req] = out["requests"]
    assert req["id"] == ids[0] and req["status"] == "identical"  # native kernels: batching changes no bit
    assert path in out["incomplete"]


async def _expect_disconnect(coro):
    try:
        return await coro
    except httpx.HTTPError as e:  # the long stream's connection dies with the server: after the kill
        raise AssertionError(f"the server went away before the short requests were answered: {e!r}") from None


_BASE = "The module defines the following functions for working with files and directories in the operating system. "
PREFIX_PROMPTS = [  # p3 begins with p1's first block: with a prefix cache it reads p1's K/V there. p1's prefill
    # (80 rows) takes another split-K than p3's own (20 rows) would: p3's bits depend on whose block it read
    {"id": "p1", "prompt": _BASE * 3, "max_tokens": 8},
    {"id": "p4", "prompt": "Return the number of items", "max_tokens": 8, "arrival": 1},
    {"id": "p3", "prompt": _BASE[:80], "max_tokens": 8, "arrival": 6},
]


def test_a_rerun_of_one_request_reruns_the_prefix_cache_blocks_it_read(tmp_path):
    """A request that read another's prefix-cache blocks gets its reference from the same blocks:
    the re-run of it alone re-runs their writer too, and gives it the bits the whole re-run gives."""
    from divergence.serve.rerun import prefix_sources, rerun

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PREFIX_PROMPTS))
    assert main(["run", "--prompts", str(prompts), "--prefix-cache", "--schedules", "concurrent",
                 "--out", str(tmp_path / "run")]) in (0, 1)
    live = tmp_path / "run" / "concurrent.h5"
    with trace_of(live) as t:
        assert prefix_sources(t, ["p3"]) == {"p1": ["p3"]}
        assert prefix_sources(t, ["p4"]) == {}
    whole, _, _ = rerun(live, tmp_path / "whole")
    one, result, _ = rerun(live, tmp_path / "one", request_ids=["p3"])
    assert result.prefix_sources == {"p1": ["p3"]}
    with trace_of(whole) as w, trace_of(one) as o:
        assert sorted(o.meta["settings"]["rerun"]["requests"]) == ["p1", "p3"]
        assert o.tokens("p3").tokens.tolist() == w.tokens("p3").tokens.tolist()
        assert o.tokens("p3").topk_logits.tobytes() == w.tokens("p3").topk_logits.tobytes()
        for key in ("k_hash", "v_hash", "position"):
            assert o.live_kv("p3")[key].tobytes() == w.live_kv("p3")[key].tobytes()
