"""`divergence serve` keeps its data to itself: the API key (401 without it, /health open),
the body bound (413, refused as it arrives, /v1/models served meanwhile) and the bound on
connections (503). Each with the official client and raw HTTP."""
from __future__ import annotations

import json
import select
import socket
import threading
import time

import httpx
import openai
import pytest

from divergence.serve.guard import API_KEY_ENV, MIN_MAX_BODY_BYTES, default_max_body_bytes

from .conftest import divergence, start_server, trace_of

KEY = "sk-divergence-test-7f3a"
AUTH = {"Authorization": f"Bearer {KEY}"}
OK = {"model": "target", "prompt": "def f(x):", "max_tokens": 2}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """A server with a key and the default body bound."""
    s = start_server(tmp_path_factory.mktemp("keyed"), "--api-key", KEY)
    yield s
    s.stop()


def _client(server, key=KEY):
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=120)


def _recorded(server) -> int:
    [path] = server.traces()
    with trace_of(path) as t:
        return len(t.requests)


def _is_openai_error(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["type"] == "invalid_request_error" and err["message"], err


# -- the key ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("POST", "/v1/completions"),
                                          ("POST", "/v1/chat/completions"), ("GET", "/v1/nothing-here")])
def test_without_the_key_every_route_but_health_is_401(keyed, method, path):
    before = _recorded(keyed)
    r = httpx.request(method, keyed.url + path, json=OK if method == "POST" else None, timeout=60)
    _is_openai_error(r, 401, "invalid_api_key")
    assert r.headers["www-authenticate"] == "Bearer"
    assert "x-divergence-trace" not in r.headers
    assert _recorded(keyed) == before


@pytest.mark.parametrize("header", [f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", "Bearer", f"Basic {KEY}", KEY,
                                    f"Bearer {KEY.upper()}", f"Bearer x{KEY}"])
def test_a_wrong_key_is_401(keyed, header):
    r = httpx.get(keyed.url + "/v1/models", headers={"Authorization": header}, timeout=60)
    _is_openai_error(r, 401, "invalid_api_key")
    assert r.json()["error"]["message"] == "incorrect API key"


def test_the_key_opens_every_route_and_the_request_is_recorded(keyed):
    assert httpx.get(keyed.url + "/v1/models", headers=AUTH, timeout=60).json()["data"][0]["id"] == "target"
    lower = httpx.get(keyed.url + "/v1/models", headers={"authorization": f"bearer {KEY}"}, timeout=60)
    assert lower.status_code == 200  # the scheme's case does not matter (RFC 9110), the key's does
    before = _recorded(keyed)
    r = httpx.post(keyed.url + "/v1/completions", json=OK, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert _recorded(keyed) == before + 1


def test_health_stays_open_and_names_the_trace_only_to_a_client_with_the_key(keyed):
    anonymous = httpx.get(keyed.url + "/health", timeout=60)
    assert anonymous.status_code == 200 and anonymous.json() == {"status": "ok", "trace": None}
    with_key = httpx.get(keyed.url + "/health", headers=AUTH, timeout=60)
    assert with_key.json()["trace"] == str(keyed.traces()[0])


def test_the_openai_client_with_a_wrong_key_gets_an_authentication_error(keyed):
    before = _recorded(keyed)
    bad = _client(keyed, key="sk-wrong")
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="target", prompt="def f(x):", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="target", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert _recorded(keyed) == before
    good = _client(keyed)
    assert [m.id for m in good.models.list().data] == ["target"]
    r = good.completions.create(model="target", prompt="def f(x):", max_tokens=2)
    assert r.usage.completion_tokens >= 1 and _recorded(keyed) == before + 1


def test_the_key_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, KEY)
    s = start_server(tmp_path)
    try:
        assert httpx.get(s.url + "/v1/models", timeout=60).status_code == 401
        assert [m.id for m in _client(s).models.list().data] == ["target"]
    finally:
        s.stop()
    assert KEY not in s.log.read_text()  # never printed


@pytest.mark.parametrize("args, env, says", [
    (["--api-key", "two words"], None, "--api-key"),
    (["--api-key", ""], None, "empty"),
    (["--api-key", "caf\u00e9"], None, "ASCII"),
    ([], "", API_KEY_ENV),
    (["--max-body-bytes", "0"], None, "--max-body-bytes"),
    (["--max-connections", "0"], None, "--max-connections"),
])
def test_a_bad_setting_is_one_line_and_exit_2(tmp_path, monkeypatch, args, env, says):
    if env is not None:
        monkeypatch.setenv(API_KEY_ENV, env)
    else:
        monkeypatch.delenv(API_KEY_ENV, raising=False)
    r = divergence("serve", "--port", "0", "--trace-dir", str(tmp_path / "live"), *args, cwd=tmp_path)
    assert r.returncode == 2
    [line] = r.stderr.splitlines()
    assert says in line and "Traceback" not in r.stderr
    assert not (tmp_path / "live").exists()


# -- the body's bound -------------------------------------------------------------------------------
def test_the_default_bound_is_4_mib_or_8_bytes_a_context_token():
    assert default_max_body_bytes(None) == default_max_body_bytes(2048) == MIN_MAX_BODY_BYTES == 4 << 20
    assert default_max_body_bytes(1 << 20) == 8 << 20


def _padded(n: int) -> bytes:
    """A valid completion body of exactly n bytes."""
    raw = json.dumps(OK).encode()
    return raw[:-1] + b" " * (n - len(raw)) + b"}"


def test_a_body_at_the_bound_is_served_one_byte_more_is_413(keyed):
    limit = default_max_body_bytes(2048)  # the fixture's context
    assert f"request bodies up to {limit} bytes" in keyed.log.read_text()
    before = _recorded(keyed)
    at = httpx.post(keyed.url + "/v1/completions", content=_padded(limit), headers=AUTH, timeout=60)
    assert at.status_code == 200, at.text
    over = httpx.post(keyed.url + "/v1/completions", content=_padded(limit + 1), headers=AUTH, timeout=60)
    _is_openai_error(over, 413, "request_too_large")
    assert str(limit) in over.json()["error"]["message"]
    assert _recorded(keyed) == before + 1


def test_a_chunked_body_is_counted_as_it_arrives(keyed):
    limit = default_max_body_bytes(2048)
    body = _padded(limit + 1)

    def chunks():
        for i in range(0, len(body), 1 << 16):
            yield body[i:i + (1 << 16)]
    r = httpx.post(keyed.url + "/v1/completions", content=chunks(), headers=AUTH, timeout=60)
    assert r.request.headers.get("transfer-encoding") == "chunked"
    _is_openai_error(r, 413, "request_too_large")
    small = _padded(4096)
    ok = httpx.post(keyed.url + "/v1/completions", content=iter([small[:100], small[100:]]), headers=AUTH, timeout=60)
    assert ok.status_code == 200, ok.text


def test_the_openai_client_sees_413(keyed):
    before = _recorded(keyed)
    with pytest.raises(openai.APIStatusError) as e:
        _client(keyed).completions.create(model="target", prompt="x" * (5 << 20), max_tokens=2)
    assert e.value.status_code == 413 and e.value.code == "request_too_large"
    assert _recorded(keyed) == before


def _connect(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=60)


def _read_response(sock: socket.socket) -> tuple[int, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(v for k, v in (h.split(b": ", 1) for h in head.split(b"\r\n")[1:])
                      if k.lower() == b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1]), body


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.parametrize("chunked", [False, True])
def test_a_huge_body_is_refused_before_it_is_sent_and_holds_nothing_up(keyed, chunked):
    """60 MB announced (or streamed in chunks): the 413 comes after the first few MB, with
    the rest never sent; meanwhile /v1/models answers, and the server's memory does not grow
    by the body (the issue measured 7.7 GB kept after one such request)."""
    huge = 60 << 20
    rss = _rss_bytes(keyed.proc.pid)
    sock = _connect(keyed)
    try:
        framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % huge
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\n" + framing + b"\r\n\r\n")
        piece = b"x" * (1 << 20)
        sent = 0
        while not select.select([sock], [], [], 0)[0]:  # until the server answers
            assert sent < 16 << 20, "no answer after 16 MB of a body past the bound"
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            sent += len(piece)
        status, body = _read_response(sock)
        assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
        assert sent < huge
        models = httpx.get(keyed.url + "/v1/models", headers=AUTH, timeout=60)  # while the connection is open
        assert models.status_code == 200
    finally:
        sock.close()
    assert _rss_bytes(keyed.proc.pid) - rss < huge // 4


def test_a_long_prompt_is_tokenised_off_the_loop(keyed):
    """A prompt near the bound takes a while to tokenise (and is then too long for the
    context: 400); /v1/models answers while it is."""
    prompt = "The quick brown fox jumps over the lazy dog. " * ((default_max_body_bytes(2048) - 200) // 45)
    raw = json.dumps({"model": "target", "prompt": prompt, "max_tokens": 2}).encode()
    sock = _connect(keyed)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(raw) + raw)
        answered = []
        while not select.select([sock], [], [], 0)[0]:
            r = httpx.get(keyed.url + "/v1/models", headers=AUTH, timeout=60)
            assert r.status_code == 200
            answered.append(time.monotonic())
            if len(answered) >= 3:
                break
        status, body = _read_response(sock)
    finally:
        sock.close()
    assert status == 400 and json.loads(body)["error"]["code"] == "context_length_exceeded"
    assert len(answered) >= 3  # three /v1/models answered while the long prompt was still being handled


# -- connections -----------------------------------------------------------------------------------
def _served_soon(server, timeout: float = 30) -> None:
    """/v1/models answers 200 once the server has seen earlier connections close."""
    deadline = time.monotonic() + timeout
    while httpx.get(server.url + "/v1/models", timeout=60).status_code != 200:
        assert time.monotonic() < deadline, "still 503 after the other connections closed"
        time.sleep(0.1)


def test_connections_past_the_bound_get_503_those_on_it_are_served(tmp_path):
    s = start_server(tmp_path, "--max-connections", "2")
    idle: list[socket.socket] = []
    try:
        idle.append(_connect(s))
        _served_soon(s)  # 2 open (the idle one and this): served
        idle.append(_connect(s))
        assert httpx.get(s.url + "/v1/models", timeout=60).status_code == 503  # a third
        r = httpx.post(s.base_url + "/completions", json=OK, timeout=60)
        assert r.status_code == 503
        with pytest.raises(openai.InternalServerError) as e:
            _client(s).models.list()
        assert e.value.status_code == 503
        for sock in idle:
            sock.close()
        idle.clear()
        _served_soon(s)
        codes = []

        def one():  # two at once, each on its own connection: both served
            codes.append(httpx.post(s.base_url + "/completions", json={**OK, "max_tokens": 8}, timeout=120).status_code)
        threads = [threading.Thread(target=one) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert codes == [200, 200]
        assert [m.id for m in _client(s).models.list().data] == ["target"]
    finally:
        for sock in idle:
            sock.close()
        s.stop()
