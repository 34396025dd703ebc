"""`divergence serve`: an OpenAI-compatible HTTP server on this engine, every step recorded."""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from pathlib import Path

from ..core.names import LOGPROBS
from ..core.settings import DEFAULT_TOKEN_BUDGET, DEFAULT_TOP_K
from ..errors import PromptError
from ..serve.guard import API_KEY_ENV, check_api_key
from .common import add_model_args, default_model_dirs
from .paths import check_output_dir

ENGINES = ("divergence", "mlx-lm")
DEFAULT_MAX_CONNECTIONS = 256
HELP = ("serve the OpenAI HTTP API (/v1/completions, /v1/chat/completions, /v1/models) on this engine, "
        "recording every step of the real traffic into a trace")


def add_arguments(p) -> None:
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8080, help="port to listen on")
    p.add_argument("--trace-dir", metavar="DIR", default="traces/live", help="where the live traces go "
                   "(live-DATE-TIME-NNN.h5, one per segment)")
    p.add_argument("--model-name", metavar="NAME", help="the model id clients send (default: the model "
                   "directory's name)")
    p.add_argument("--policy", default="native", help="kernel policy: native | batch-invariant | threshold:N")
    p.add_argument("--spec-k", type=int, help="the most draft tokens per verify (default: 3 with --draft, else 0)")
    p.add_argument("--spec-adaptive", action="store_true", help="each round, propose as many draft tokens, 0 to "
                   "--spec-k, as give the most tokens per second (measured per length as it serves; default: "
                   "--spec-k every round, so the trace shows every speculative round)")
    p.add_argument("--token-budget", type=int, default=DEFAULT_TOKEN_BUDGET, help="rows per engine step")
    p.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, help="top-k logits recorded per token (the most "
                   "top_logprobs a request may ask for)")
    p.add_argument("--kv-blocks", type=int, default=2048, help="KV-cache blocks (of 16 positions) per model: "
                   "what running requests hold at once; a request needing more than all is refused (400), one "
                   "needing more than are free waits")
    p.add_argument("--prefix-cache", action="store_true", help="reuse cached KV blocks of shared prompt prefixes")
    p.add_argument("--ignore-eos", action="store_true", help="generate max_tokens even past end-of-text")
    p.add_argument("--rotate-mb", type=float, metavar="MB", help="start a new trace once the current one is "
                   "this large (the running requests finish in it first)")
    p.add_argument("--rotate-minutes", type=float, metavar="MIN", help="start a new trace after this long")
    p.add_argument("--no-kv-hashes", action="store_true", help="don't record KV-write hashes")
    p.add_argument("--api-key", metavar="KEY", help="require the header 'Authorization: Bearer KEY' on every "
                   "route but /health (401 without it), as vLLM's --api-key (default: the environment variable "
                   f"{API_KEY_ENV}, which keeps the key out of the process list; unset: no key)")
    p.add_argument("--max-body-bytes", type=int, metavar="N", help="the largest request body taken (413 past it: "
                   "counted as it arrives, never held past N; default: 4 MiB, or 8 bytes per token of the model's "
                   "context where that is more)")
    p.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS, metavar="N", help="connections "
                   "served at once; a request on one more is answered 503")
    p.add_argument("--engine", choices=ENGINES, default="divergence", help="what generates: this engine, or "
                   "mlx-lm's own BatchGenerator (mlx_lm.server's engine) through the recording adapter, so the "
                   "live trace is of mlx-lm's engine (no draft, native kernels; --kv-blocks, --token-budget and "
                   "--prefix-cache are this engine's)")


def main(args) -> int:
    from ..engine.kernels.dispatch import KernelPolicy  # (lazy: loads MLX; the parser imports every command)

    KernelPolicy.parse(args.policy)
    for flag, v, lo in (("--port", args.port, 0), ("--kv-blocks", args.kv_blocks, 1), ("--top-k", args.top_k, 1),
                        ("--token-budget", args.token_budget, 1), ("--max-body-bytes", args.max_body_bytes, 1),
                        ("--max-connections", args.max_connections, 1)):
        if v is not None and v < lo:
            raise PromptError(f"{flag} must be >= {lo}, got {v}")
    api_key(args)  # a bad key: one line, before the model loads
    for flag, v in (("--rotate-mb", args.rotate_mb), ("--rotate-minutes", args.rotate_minutes)):
        if v is not None and v <= 0:
            raise PromptError(f"{flag} must be > 0, got {v}")
    if args.engine == "mlx-lm":
        for flag, bad in (("--draft", args.draft), ("--spec-k", args.spec_k), ("--prefix-cache", args.prefix_cache),
                          ("--spec-adaptive", args.spec_adaptive), ("--policy", args.policy != "native")):
            if bad:
                raise PromptError(f"--engine mlx-lm takes no {flag} (mlx-lm's BatchGenerator batches without a "
                                  f"draft, on the backend's own kernels)")
    spec_k = args.spec_k if args.spec_k is not None else (3 if args.draft else 0)
    target_dir, draft_dir = default_model_dirs()
    check_output_dir(args.trace_dir, flag="--trace-dir")
    from ..engine.engine import Engine  # (lazy: loads MLX; the parser imports every command)
    from ..workloads.runner import RunConfig  # (lazy: loads numpy and h5py; the parser imports every command)

    mlxlm = args.engine == "mlx-lm"
    cfg = RunConfig(model=args.model or target_dir, draft=(args.draft or draft_dir) if spec_k else None,
                    dtype=args.dtype, policy=args.policy, spec_k=spec_k, token_budget=args.token_budget,
                    top_k=args.top_k, prefix_caching=args.prefix_cache, stop_at_eos=not args.ignore_eos)
    settings = cfg.settings()
    if mlxlm:  # the engine over the model answers the HTTP side's questions; mlx-lm generates
        settings["topk_values"] = LOGPROBS
    engine = Engine.from_settings(settings, model_dir=cfg.model, draft_dir=cfg.draft,
                                  num_blocks=None if mlxlm else args.kv_blocks)
    if engine.top_k > engine.vocab:
        raise PromptError(f"--top-k {engine.top_k} is larger than the model's vocabulary ({engine.vocab} tokens)")
    return serve(engine, args, model_id=args.model_name or Path(cfg.model).resolve().name)


def api_key(args) -> str | None:
    """--api-key, else $DIVERGENCE_API_KEY, else None; a key no header can carry is refused."""
    key, flag = getattr(args, "api_key", None), "--api-key"
    if key is None:
        key, flag = os.environ.get(API_KEY_ENV), API_KEY_ENV
    if key is None:
        return None
    why = check_api_key(key)
    if why:
        raise PromptError(f"{flag}: {why}")
    return key


def serve(engine, args, *, model_id: str) -> int:
    import uvicorn  # (lazy: the HTTP stack, only to serve; the parser imports every command)

    from ..serve.app import Server  # (lazy: loads starlette and MLX; the parser imports every command)
    from ..serve.worker import EngineWorker  # (lazy: loads MLX and h5py; the parser imports every command)

    try:  # a port in use is one line, before the engine starts
        sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
    except OSError as e:
        raise PromptError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None

    def recording(path) -> None:
        print(f"divergence serve: recording to {path}", file=sys.stderr, flush=True)

    control = None
    if engine.draft is not None and getattr(args, "spec_adaptive", False):
        from ..engine.speculative import AdaptiveDraft  # (lazy: loads numpy; the parser imports every command)

        control = AdaptiveDraft(engine.spec_k)
    mlxlm = getattr(args, "engine", "divergence") == "mlx-lm"
    worker_class = EngineWorker
    if mlxlm:
        from ..serve.mlxlm import MlxLmWorker  # (lazy: loads mlx-lm; the parser imports every command)

        worker_class = MlxLmWorker
    worker = worker_class(engine, args.trace_dir,
                          rotate_bytes=int(args.rotate_mb * 1e6) if args.rotate_mb else None,
                          rotate_seconds=args.rotate_minutes * 60 if args.rotate_minutes else None,
                          kv_hashes=not args.no_kv_hashes, on_segment=recording, spec_control=control)
    server = Server(engine, worker, model_id=model_id)
    host, port = sock.getsockname()[:2]
    d = engine.draft
    print(f"divergence serve: {model_id} ({engine.target.path}, {engine.target.dtype})"
          + (", mlx-lm BatchGenerator" if mlxlm else "")
          + (f", draft {d.path}, spec k={'up to ' if control else ''}{engine.spec_k}" if d else "")
          + f", policy {engine.policy}", file=sys.stderr)
    print(f"divergence serve: http://{host}:{port}/v1", file=sys.stderr, flush=True)
    # The engine runs on this (main) thread, the HTTP server on its own: MLX aborts the process
    # at exit after streams ran on another thread. SIGTERM / Ctrl-C: uvicorn finishes the
    # responses in flight (the engine still stepping), then the engine drains and the trace closes.
    key = api_key(args)
    app = server.app(api_key=key, max_body_bytes=getattr(args, "max_body_bytes", None))
    if key is not None:
        print("divergence serve: requests need 'Authorization: Bearer KEY' (all but /health)", file=sys.stderr)
    connections = getattr(args, "max_connections", DEFAULT_MAX_CONNECTIONS)
    print(f"divergence serve: request bodies up to {app.max_body_bytes} bytes, {connections} connections at once",
          file=sys.stderr)
    # uvicorn answers 503 once `limit_concurrency` connections are open, the request's own counted
    http = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=60, lifespan="off",
                                         limit_concurrency=connections + 1))

    def http_thread() -> None:
        try:
            http.run(sockets=[sock])
        finally:
            worker.stop()

    def on_signal(sig, frame) -> None:
        http.should_exit = True

    before = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    t = threading.Thread(target=http_thread, name="divergence-http", daemon=True)
    try:
        t.start()
        worker.run()
    finally:
        http.should_exit = True
        t.join(70)
        server.close()
        for sig, handler in before.items():
            signal.signal(sig, handler)
    for path in worker.traces:
        print(f"divergence serve: trace {path}", file=sys.stderr)
    if control is not None and control.chosen:
        print("divergence serve: draft tokens per round: " + ", ".join(
            f"{k}: {n} rounds" for k, n in sorted(control.chosen.items())), file=sys.stderr)
        print("divergence serve: tokens/s per sequence measured at each draft length: " + ", ".join(
            f"{k}: {v:.1f}" for k, v in sorted(control.rate.items())), file=sys.stderr)
    print(f"next: divergence rerun {worker.current_trace} --out traces/rerun", file=sys.stderr)
    return 0
