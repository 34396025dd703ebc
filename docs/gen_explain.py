#!/usr/bin/env python3
"""docs/generated/explain.txt: `divergence explain` on real traffic to a server it starts.

    python docs/gen_explain.py        # about a minute on 2 cores

In a fresh temporary directory, as a user would: `divergence serve` with the demo's settings
(the fixture draft, speculative decoding, threshold:4, so batching changes the kernels), eight
clients at once (clients.py, shown), then `divergence explain` of a response whose text
changed under batching (which one: the script re-runs them all once and diffs, as a user
would not need to), while the server still runs. The file holds each command after `$ ` and
what it printed, paths relative (as docs/gen_outputs.py writes its shows).
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_outputs import GENERATED, ROOT, _FIXTURES, _argv, environment  # noqa: E402

CLIENTS = '''import asyncio, sys
import openai

PROMPTS = ["def add(a, b):\\n    ", "Return the number of", "class Stack:\\n    \\"\\"\\"", "import os\\nimport",
           "The quick brown", "    for i in range(", "def __init__(self", "Raise ValueError if"]

async def main(port):
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-")
    async def one(i):
        r = await client.completions.create(model="target", prompt=PROMPTS[i] * (1 + i % 3), max_tokens=48)
        return r.id, r.choices[0].text
    for rid, text in await asyncio.gather(*(one(i) for i in range(8))):
        print(rid, repr(text[:40]))

asyncio.run(main(int(sys.argv[1])))
'''


def run(command: str, cwd: Path) -> str:
    p = subprocess.run(_argv(command), cwd=cwd, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=900)
    return p.stdout


def main() -> int:
    from divergence.parallel.launch import free_ports

    [port] = free_ports(1)
    with tempfile.TemporaryDirectory(prefix="divergence-docs-explain-") as tmp:
        work = Path(tmp).resolve()
        (work / "clients.py").write_text(CLIENTS)
        serve = f"divergence serve --draft {ROOT}/fixtures/draft --policy threshold:4 --port {port} " \
                f"--trace-dir traces/live"
        log = open(work / "serve.log", "w")
        server = subprocess.Popen(_argv(serve), cwd=work, env=environment(), stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait(work / "serve.log", server)
            out = [f"$ {serve} &\n", (work / "serve.log").read_text()]
            out += [f"$ python clients.py {port}\n", run(f"python clients.py {port}", work)]
            [live] = sorted((work / "traces" / "live").glob("live-*.h5"))
            rel = live.relative_to(work)
            run(f"divergence rerun {rel} --out ref", work)  # (not shown: which response to explain)
            d = json.loads(run(f"divergence diff ref/serial.h5 {rel} --json", work))
            diverged = [q["id"] for q in d["requests"] if q["status"] == "diverged" and q["first_divergent_token"]]
            if not diverged:
                print("gen_explain: no response diverged this time; run it again", file=sys.stderr)
                return 1
            command = f"divergence explain {rel} {diverged[0]}"
            out += [f"$ {command}\n", run(command, work)]
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(120)
            log.close()
        text = "".join(out)
        for path in (str(work) + "/", str(work), str(ROOT) + "/", str(ROOT)):
            text = text.replace(path, "")
        text = _FIXTURES.sub(r"fixtures/\2", text).replace(f"--port {port}", "--port 8080").replace(
            f"clients.py {port}", "clients.py 8080").replace(f"127.0.0.1:{port}", "127.0.0.1:8080")
    GENERATED.mkdir(parents=True, exist_ok=True)
    tmp_out = GENERATED / ".explain.txt.tmp"
    tmp_out.write_text(text)
    tmp_out.replace(GENERATED / "explain.txt")
    print(f"wrote docs/generated/explain.txt ({len(text.splitlines())} lines)")
    return 0


def _wait(log: Path, server: subprocess.Popen, timeout: float = 180) -> None:
    """Until the server records (its log names the trace)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited:\n{log.read_text()}")
        if "recording to" in log.read_text():
            return
        time.sleep(0.2)
    raise SystemExit(f"the server did not start:\n{log.read_text()}")


if __name__ == "__main__":
    sys.exit(main())
