"""HTTP serving: `divergence serve` (tracing on) vs `mlx_lm.server`, the same model and the
same client load, with and without a draft model.

    python bench/bench_serve.py --quick            # fixture models, 32 requests x 16 tokens, prompts 8-64, 3 reps
    python bench/bench_serve.py                    # 32 requests x 64 tokens, prompts 8-256 tokens, 5 reps
    python bench/bench_serve.py --target DIR --draft DIR --requests 64 --concurrency 16

The script starts the servers itself on free ports of 127.0.0.1 (mlx_lm.server without and
with --draft-model; divergence serve without a draft, with --draft (3 draft tokens every
round: mode `draft`) and with --draft --spec-adaptive (up to 3 a round, as many as pay:
mode `draft-adaptive`); 3 draft tokens on mlx_lm.server) and stops them at the end. Both
draft modes are compared with the one mlx_lm.server --draft-model run. One async client (httpx, in this process) sends the load: --requests
completions, at most --concurrency in flight, prompts of mixed lengths (windows of real
text, drawn per request), all streamed (SSE, stream_options.include_usage), temperature 0,
the same max_tokens. Both sides generate exactly max_tokens: divergence serve runs with
--ignore-eos, mlx_lm.server gets logit_bias -1e9 on the EOS id; the counts are checked from
each response's usage (the table says where they differ). mlx_lm.server batches a request
only without a seed, so none is sent; with a draft model it serves requests one at a time.

Each repetition sends a fresh prompt set (so no server answers from its prompt cache) to
the four servers in a rotating order. Per repetition and server: requests/s and tokens/s
(over the wall time from the first request sent to the last answered), p50/p99 of the
latency (request sent -> last byte) and of the time to first token (request sent -> first
text chunk). Ratios are medians over repetitions of divergence / mlx-lm in that
repetition: > 1 is better for the rates, < 1 for the latencies. Goal (issue 31):
throughput >= 1.0x without a draft, >= 1.5x with one.

Writes bench/results/serve.json (--quick: a temp dir, unless --out is given).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import common as C  # noqa: I001  (first: sys.path + BLAS before mlx)

import httpx
import numpy as np

from divergence.parallel.launch import free_ports

GOAL = {"plain": 1.0, "draft": 1.5, "draft-adaptive": 1.5}
MODES = ("plain", "draft", "draft-adaptive")  # draft: k=3 every round; draft-adaptive: --spec-adaptive


def mlx_mode(mode: str) -> str:
    """The mlx_lm.server run a divergence mode is compared with (both draft modes: --draft-model)."""
    return "draft" if mode.startswith("draft") else mode
SPEC_K = 3
START_TIMEOUT_S = 180
REQUEST_TIMEOUT_S = 600


@dataclass
class Server:
    name: str  # mlx-lm | divergence
    mode: str  # plain | draft
    argv: list[str]
    model_id: str
    log: Path
    port: int = 0
    proc: subprocess.Popen | None = None
    extra: dict = field(default_factory=dict)  # fields every request to this server carries

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(C.ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(self.argv + ["--port", str(self.port)], stdout=out,
                                         stderr=subprocess.STDOUT, env=env, cwd=str(self.log.parent))

    def wait_ready(self) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < START_TIMEOUT_S:  # /health: 200 once the model is loaded (and the trace open)
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} ({self.mode}) exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise SystemExit(f"{self.name} ({self.mode}) did not answer /health in {START_TIMEOUT_S} s:\n"
                         f"{self.log.read_text()[-3000:]}")

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


def servers(target: Path, draft: Path, work: Path, eos: int) -> list[Server]:
    py = sys.executable
    out = []
    for mode in MODES:
        d = mode != "plain"
        if mode == mlx_mode(mode):
            mlx = [py, "-m", "mlx_lm.server", "--model", str(target), "--host", "127.0.0.1", "--log-level", "WARNING"]
            if d:
                mlx += ["--draft-model", str(draft), "--num-draft-tokens", str(SPEC_K)]
            out.append(Server("mlx-lm", mode, mlx, "default_model", work / f"mlx-{mode}.log",
                              extra={"logit_bias": {str(eos): -1e9}}))
        div = [py, "-m", "divergence", "serve", "--model", str(target), "--host", "127.0.0.1", "--ignore-eos",
               "--trace-dir", str(work / f"live-{mode}")]
        if d:
            div += ["--draft", str(draft), "--spec-k", str(SPEC_K)] + (["--spec-adaptive"] if mode == "draft-adaptive" else [])
        out.append(Server("divergence", mode, div, target.resolve().name, work / f"divergence-{mode}.log"))
    return out


def make_prompts(tokenizer, n: int, lo: int, hi: int, seed: int) -> list[str]:
    """n prompts of lo..hi tokens: windows of real text at offsets no other prompt of the run starts at."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(lo, hi + 1, size=n)
    stream = C.token_stream(lambda t: tokenizer.encode(t, add_special_tokens=False), int(lens.sum()) + 64 * n)
    starts = rng.choice(len(stream) - hi, size=n, replace=False)
    return [tokenizer.decode(stream[int(s): int(s) + int(k)]) for s, k in zip(starts, lens)]


async def one_request(client: httpx.AsyncClient, srv: Server, prompt: str, max_tokens: int) -> dict:
    body = {"model": srv.model_id, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, **srv.extra}
    t0 = time.perf_counter()
    first, usage, text = None, None, []
    async with client.stream("POST", srv.url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{srv.name} ({srv.mode}): HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue  # mlx_lm.server's ': keepalive' comments, blank separators
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices") or []:
                if c.get("text"):
                    text.append(c["text"])
                    if first is None:
                        first = time.perf_counter()
    t1 = time.perf_counter()
    if usage is None:
        raise RuntimeError(f"{srv.name} ({srv.mode}) sent no usage chunk")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"latency": t1 - t0, "ttft": (first or t1) - t0, "tokens": int(usage["completion_tokens"]),
            "prompt_tokens": int(usage["prompt_tokens"]), "cached_tokens": int(cached), "text": "".join(text)}


async def load(srv: Server, prompts: list[str], max_tokens: int, concurrency: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        async def bounded(p):
            async with sem:
                return await one_request(client, srv, p, max_tokens)

        t0 = time.perf_counter()
        got = await asyncio.gather(*(bounded(p) for p in prompts))
        wall = time.perf_counter() - t0
    lat = [g["latency"] for g in got]
    ttft = [g["ttft"] for g in got]
    tokens = sum(g["tokens"] for g in got)
    return {"wall_s": wall, "requests_per_s": len(got) / wall, "tokens_per_s": tokens / wall,
            "latency_p50_s": float(np.percentile(lat, 50)), "latency_p99_s": float(np.percentile(lat, 99)),
            "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
            "tokens": tokens, "per_request_tokens": [g["tokens"] for g in got],
            "prompt_tokens": [g["prompt_tokens"] for g in got], "cached_tokens": sum(g["cached_tokens"] for g in got),
            "texts": [g["text"] for g in got]}


METRICS = ("requests_per_s", "tokens_per_s", "latency_p50_s", "latency_p99_s", "ttft_p50_s", "ttft_p99_s")
BETTER = {"requests_per_s": "higher", "tokens_per_s": "higher"}
LABELS = {"requests_per_s": "requests/s", "tokens_per_s": "tokens/s", "latency_p50_s": "latency p50 (s)",
          "latency_p99_s": "latency p99 (s)", "ttft_p50_s": "TTFT p50 (s)", "ttft_p99_s": "TTFT p99 (s)"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 tokens, prompts 8-64 tokens, 3 reps (~2 min)")
    ap.add_argument("--target", help="target model directory, or fixture | qwen0.5b | qwen0.5b-4bit "
                    "(default: the embedded fixture)")
    ap.add_argument("--draft", help="draft model directory (default: the embedded fixture's draft)")
    ap.add_argument("--draft-layers", type=int, help="the draft: the target's first N layers (its own "
                    "embedding and head; written once next to the target), instead of --draft")
    ap.add_argument("--model-cache", default=None, help="where the random qwen0.5b model is generated/reused")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument("--min-prompt", type=int, default=8)
    ap.add_argument("--max-prompt", type=int)
    ap.add_argument("--reps", type=int)
    ap.add_argument("--modes", default="plain,draft,draft-adaptive", help="plain, draft (3 draft tokens a round), "
                    "draft-adaptive (--spec-adaptive: up to 3, as many as pay), comma-separated")
    ap.add_argument("--warmup", type=int, default=2, help="requests each server gets before the measured load "
                    "(the same load's concurrency), unmeasured")
    ap.add_argument("--out", help="the JSON file (default: bench/results/serve.json; --quick: a temp dir)")
    args = ap.parse_args()
    t_start = time.monotonic()
    load_before = os.getloadavg()  # (other work on the machine: the ratios' noise)
    args.max_tokens = args.max_tokens or (4 if args.quick else 64)
    args.max_prompt = args.max_prompt or (16 if args.quick else 256)
    args.reps = args.reps or (1 if args.quick else 5)
    if args.quick:  # a check that it runs, not a measurement
        args.requests, args.warmup = min(args.requests, 4), min(args.warmup, 1)
    modes = [m for m in args.modes.split(",") if m]
    target, draft, where = C.fixture_paths(None if args.target in (None, "fixture") else args.target, args.draft)
    if args.target and not Path(args.target).is_dir():
        target = C.model_path(args.target, C.fixture_paths()[0], args.model_cache)
    if args.draft_layers:
        draft = C.truncated_model(target, target.parent / f"{target.name}-first{args.draft_layers}", args.draft_layers)
        where = f"the draft is the target's first {args.draft_layers} layers"

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    eos = tok.eos_token_id if tok.eos_token_id is not None else 0
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"--modes: unknown mode {bad[0]!r} (modes: {', '.join(MODES)})")
    want = set(modes) | {mlx_mode(m) for m in modes}
    all_srv = [s for s in servers(target, draft, work, eos)
               if ((s.mode in modes) if s.name == "divergence" else (s.mode in want))]
    print(f"[bench] target {target}, draft {draft} ({where}); {args.requests} requests, {args.concurrency} "
          f"concurrent, prompts {args.min_prompt}-{args.max_prompt} tokens, {args.max_tokens} tokens each, "
          f"{args.reps} reps; logs and traces in {work}", flush=True)
    for s, port in zip(all_srv, free_ports(len(all_srv))):  # distinct: held open together
        s.port = port
    results: dict[tuple[str, str], list[dict]] = {(s.name, s.mode): [] for s in all_srv}
    startup = {}
    try:
        for s in all_srv:  # one at a time: two loading at once on 2 cores would slow both
            s.start()
            startup[f"{s.name}/{s.mode}"] = round(s.wait_ready(), 2)
            warm = make_prompts(tok, args.warmup, args.min_prompt, args.max_prompt, seed=10_000)
            # compiles, first allocations; with --warmup N, a load of N requests (divergence's
            # adaptive draft length learns there what a server running a while would know)
            asyncio.run(load(s, warm, args.max_tokens, min(args.concurrency, args.warmup)))
            print(f"[bench] {s.name} ({s.mode}) ready in {startup[f'{s.name}/{s.mode}']:.1f} s on {s.url}", flush=True)
        for rep in range(args.reps):
            prompts = make_prompts(tok, args.requests, args.min_prompt, args.max_prompt, seed=rep)
            order = all_srv[rep % len(all_srv):] + all_srv[: rep % len(all_srv)]
            for s in order:
                r = asyncio.run(load(s, prompts, args.max_tokens, args.concurrency))
                results[(s.name, s.mode)].append(r)
                print(f"[bench] rep {rep + 1}/{args.reps} {s.name:<10} {s.mode:<5} {r['wall_s']:6.2f} s  "
                      f"{r['tokens_per_s']:7.1f} tok/s  p50 {r['latency_p50_s']:.2f} s  ttft p50 "
                      f"{r['ttft_p50_s']:.3f} s", flush=True)
    finally:
        codes = {f"{s.name}/{s.mode}": s.stop() for s in all_srv}
    loadavg = {"start": [round(x, 2) for x in load_before], "end": [round(x, 2) for x in os.getloadavg()],
               "cpus": os.cpu_count()}
    return report(args, modes, results, startup, codes, work, target, draft, time.monotonic() - t_start, loadavg)


def draft_rounds(log: Path) -> dict | None:
    """divergence serve's last words: how many rounds ran at each draft length (adaptive)."""
    try:
        text = log.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if "draft tokens per round:" in line:
            pairs = (p.strip().split(":") for p in line.split("draft tokens per round:")[1].split(","))
            return {int(k): int(v.split()[0]) for k, v in pairs}
    return None


def report(args, modes, results, startup, codes, work, target, draft, elapsed: float, loadavg: dict) -> int:
    rows, out = [], []
    for mode in modes:
        d, m = results[("divergence", mode)], results[("mlx-lm", mlx_mode(mode))]
        same_tokens = all(a["per_request_tokens"] == b["per_request_tokens"] for a, b in zip(d, m))
        same_prompts = all(a["prompt_tokens"] == b["prompt_tokens"] for a, b in zip(d, m))
        same_text = sum(x == y for a, b in zip(d, m) for x, y in zip(a["texts"], b["texts"]))
        entry = {"mode": mode, "ratios": {}, "ratio_per_rep": {}, "divergence": {}, "mlx_lm": {}, "same_token_counts": same_tokens,
                 "same_prompt_tokens": same_prompts, "same_text": f"{same_text}/{args.requests * args.reps}",
                 "cached_prompt_tokens": {"divergence": sum(a["cached_tokens"] for a in d),
                                          "mlx_lm": sum(b["cached_tokens"] for b in m)},
                 "goal_throughput_ratio": GOAL[mode], "against": f"mlx-lm/{mlx_mode(mode)}",
                 "draft_tokens_per_round": draft_rounds(work / f"divergence-{mode}.log")}
        for k in METRICS:
            ratio = C.paired_ratio([a[k] for a in d], [b[k] for b in m])
            entry["ratios"][k] = ratio
            entry["divergence"][k] = C.summary([a[k] for a in d])
            entry["mlx_lm"][k] = C.summary([b[k] for b in m])
            per_rep = [a[k] / b[k] for a, b in zip(d, m) if b[k]]
            entry["ratio_per_rep"][k] = per_rep
            rows.append([mode, LABELS[k], BETTER.get(k, "lower"), C.fmt(entry["mlx_lm"][k]["median"], 3),
                         C.fmt(entry["divergence"][k]["median"], 3), f"{C.fmt(ratio)}x",
                         f"{C.fmt(min(per_rep))}-{C.fmt(max(per_rep))}" if per_rep else "-"])
        entry["meets_goal"] = (entry["ratios"]["tokens_per_s"] or 0) >= GOAL[mode]
        out.append(entry)
    print(f"\nmedians over {args.reps} reps; div/mlx: median of the per-rep ratios (their range: per rep)")
    print(C.table(rows, ["mode", "metric", "better", "mlx-lm", "divergence", "div/mlx", "per rep"]))
    for e in out:
        print(f"  {e['mode']}: tokens per request equal on both sides: {C.fmt(e['same_token_counts'])}; prompt "
              f"tokens equal: {C.fmt(e['same_prompt_tokens'])}; same text {e['same_text']}; prompt-cache hits "
              f"(tokens) divergence {e['cached_prompt_tokens']['divergence']}, mlx-lm "
              f"{e['cached_prompt_tokens']['mlx_lm']}; throughput goal >= {e['goal_throughput_ratio']}x: "
              f"{C.fmt(e['meets_goal'])}" + (f"; divergence's rounds per draft length {e['draft_tokens_per_round']}"
                                             if e["draft_tokens_per_round"] else ""))
    traces = sorted(str(p) for p in work.glob("live-*/live-*.h5"))
    for r in results.values():
        for x in r:
            x.pop("texts")
    data = {"bench": "serve", "quick": args.quick, "meta": C.meta(args), "target": str(target), "draft": str(draft),
            "load": {"requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                     "warmup_requests": args.warmup,
                     "prompt_tokens": [args.min_prompt, args.max_prompt], "reps": args.reps, "temperature": 0,
                     "stream": True, "spec_k": SPEC_K},
            "elapsed_s": round(elapsed, 1), "loadavg_1_5_15min": loadavg, "startup_s": startup, "exit_codes": codes, "divergence_traces": traces, "results": out,
            "samples": {f"{n}/{m}": r for (n, m), r in results.items()}}
    C.write_json(C.out_path("serve", args.quick, args.out), data)
    print(f"[bench] {elapsed:.0f} s in all; load average (1, 5, 15 min) at the start {loadavg['start']}, at the "
          f"end {loadavg['end']} on {loadavg['cpus']} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
