"""A `divergence serve` process on a free port of 127.0.0.1, started and stopped by the test."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from divergence.cli.common import default_model_dirs
from divergence.parallel.launch import free_ports
from divergence.trace.reader import Trace

ROOT = Path(__file__).resolve().parents[2]
TARGET, DRAFT = default_model_dirs()
START_TIMEOUT_S = 120


@dataclass
class Served:
    proc: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    trace_dir: Path
    log: Path

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def traces(self) -> list[Path]:
        return sorted(self.trace_dir.glob("live-*.h5"))

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"the server did not stop within {timeout} s after {sig!r}:\n{self.log.read_text()}")


def start_server(tmp: Path, *args: str) -> Served:
    [port] = free_ports(1)
    trace_dir = tmp / "live"
    log = tmp / f"serve-{port}.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "divergence", "serve", "--model", str(TARGET), "--host",
                                 "127.0.0.1", "--port", str(port), "--trace-dir", str(trace_dir), *args],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(tmp))
    s = Served(proc, f"http://127.0.0.1:{port}", trace_dir, log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited ({proc.returncode}):\n{log.read_text()}")
        try:
            if httpx.get(s.url + "/health", timeout=2).status_code == 200:
                return s
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    s.stop(signal.SIGKILL)
    raise AssertionError(f"the server did not answer within {START_TIMEOUT_S} s:\n{log.read_text()}")


@pytest.fixture
def serve(tmp_path):
    """serve(*args) -> Served; every server started is stopped at the end (SIGTERM, then SIGKILL)."""
    started: list[Served] = []

    def make(*args: str) -> Served:
        s = start_server(tmp_path, *args)
        started.append(s)
        return s

    yield make
    for s in started:
        if s.proc.poll() is None:
            try:
                s.stop()
            except AssertionError:
                pass


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    """One server for a module: the fixture models, speculative decoding (k=3), threshold:4."""
    s = start_server(tmp_path_factory.mktemp("serve"), "--draft", str(DRAFT), "--policy", "threshold:4")
    yield s
    s.stop()


def divergence(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "divergence", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=600)


def answer(model, tokens) -> str:
    """The text a response carries for these generated tokens: an end-of-text that ended
    them has none."""
    tokens = list(tokens)
    eos = set(getattr(model.tokenizer, "eos_token_ids", None) or [])
    return model.decode(tokens[:-1] if tokens and tokens[-1] in eos else tokens)


def trace_of(path: Path):
    return Trace.open(path)


@pytest.fixture(scope="module")
def model():
    from divergence.engine.model.loading import load_cached

    return load_cached(TARGET)


def openai_client(server):
    """The official client on a started server (no retries: a failure shows as it is)."""
    import openai

    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def recorded(server, rid: str):
    """(prompt tokens, generated tokens, event kinds, TraceRequest) of a request in the server's trace."""
    [path] = server.traces()
    with trace_of(path) as t:
        req = next(r for r in t.requests if r.id == rid)
        ev = t.table("request_events")
        kinds = [str(k) for k, i in zip(ev["kind"], ev["request"]) if int(i) == t.request_index(rid)]
        return list(req.prompt_tokens), t.tokens(rid).tokens.tolist(), kinds, req
