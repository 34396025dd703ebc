"""The HTTP side of `divergence serve`: OpenAI's /v1/completions, /v1/chat/completions and
/v1/models on starlette, SSE streaming through StreamingResponse.

A handler validates and tokenises the request, submits it to the engine thread and awaits
its results on an asyncio queue the engine thread fills (loop.call_soon_threadsafe): the
loop never waits for a step. A client that goes away cancels its request. Each response
names its request's id in the trace (`id`, and the X-Divergence-Request-Id header) and the
trace file (X-Divergence-Trace). Tokenising runs on a thread of its own, so that a long
prompt never holds the loop (nor /v1/models); guard.py checks the key and bounds the body.
"""
from __future__ import annotations

import asyncio
import itertools
from concurrent.futures import ThreadPoolExecutor
import json
import time

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ..core.names import LOGPROBS
from ..core.request import Request
from .guard import ApiKey, Guard, default_max_body_bytes
from .live import CANCELLED, STOP, LiveRequest, Sink
from .openai_schema import CHAT, COMPLETION, DEFAULT_MAX_TOKENS, ApiError, Parsed, parse
from .text import Detokenizer, chat_prompt, token_logprobs

FINISH = {"eos": "stop", "length": "length", STOP: "stop"}
DISCONNECT_POLL_S = 0.25


class QueueSink(Sink):
    """Engine thread -> the request's asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def _put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop closed (shutdown): nobody is waiting
            pass

    def joined(self, trace_path) -> None:
        self._put(("joined", trace_path))

    def token(self, event) -> None:
        self._put(("token", event))

    def done(self, reason: str) -> None:
        self._put(("done", reason))


class Generation:
    """One request's results as the response builds them: text, tokens, log-probs."""

    def __init__(self, server: "Server", parsed: Parsed, rid: str, prompt_len: int):
        self.server, self.p, self.id, self.prompt_len = server, parsed, rid, prompt_len
        self.detok = Detokenizer(server.engine.decode, parsed.stop)
        self.logprobs: list[tuple[int, float, list, int]] = []  # (token, logprob, top, text offset)
        self.finish: str | None = None
        self.tokens = 0  # generated so far (usage), the end-of-text that ended it included
        e = server.engine
        self.silent = e.eos_ids if e.stop_at_eos else set()  # a stop token has no text (as mlx_lm.server)
        self.tempered = e.topk_values != LOGPROBS

    def add(self, event) -> str:
        if self.detok.stopped:
            return ""
        self.tokens += 1
        start = len(self.detok.text.rstrip("\ufffd"))  # where its text begins (after a partial character: at it)
        delta = "" if int(event.token) in self.silent else self.detok.add(event.token)
        if self.p.logprobs is not None:  # (mlx-lm's engine records the untempered log-probs, and reports them)
            lp, top = token_logprobs(event, self.p.sampling.temperature if self.tempered else 0.0)
            self.logprobs.append((int(event.token), lp, top[: self.p.logprobs], start))
        return delta

    def usage(self) -> dict:
        n = self.tokens
        return {"prompt_tokens": self.prompt_len, "completion_tokens": n, "total_tokens": self.prompt_len + n}

    def logprobs_json(self, entries) -> dict | None:
        if self.p.logprobs is None:
            return None
        piece = self.server.piece
        if self.p.kind == CHAT:
            return {"content": [{"token": piece(t), "logprob": lp, "bytes": list(piece(t).encode()),
                                 "top_logprobs": [{"token": piece(i), "logprob": v, "bytes": list(piece(i).encode())}
                                                  for i, v in top]} for t, lp, top, _ in entries]}
        # text_offset: where each token's text starts in the completion's text (streamed: in the
        # text of all chunks joined); no echo, so the prompt is not counted (as vLLM). Past a
        # stop string's cut, a token starts where the text ends.
        return {"tokens": [piece(t) for t, *_ in entries], "token_logprobs": [e[1] for e in entries],
                "top_logprobs": [{piece(i): v for i, v in e[2]} for e in entries],
                "text_offset": [min(e[3], len(self.detok.text)) for e in entries]}


class Server:
    def __init__(self, engine, worker, *, model_id: str):
        self.engine, self.worker, self.model_id = engine, worker, model_id
        self.created = int(time.time())
        self._ids = itertools.count(1)
        self.pieces = engine.vocab_pieces()
        # one thread: the tokenizer is used by one request at a time, as on the loop before
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="divergence-tokenize")

    def close(self) -> None:
        """End the tokenizing thread (a thread left waiting would hold the process's exit)."""
        self._tokenizing.shutdown(wait=True, cancel_futures=True)

    def piece(self, token: int) -> str:
        return self.pieces[token] if 0 <= token < len(self.pieces) else ""

    def next_id(self, kind: str) -> str:
        return f"{'cmpl' if kind == COMPLETION else 'chatcmpl'}-{next(self._ids):06d}"

    # -- request -> engine request ----------------------------------------------------------
    def prepare(self, p: Parsed) -> tuple[list[int], int]:
        """(prompt tokens, max_tokens); a prompt or length the engine cannot hold is an ApiError."""
        e = self.engine
        if p.kind == CHAT:
            tokens = chat_prompt(e.target, p.messages)
        else:
            tokens = list(e.encode(p.prompt)) if isinstance(p.prompt, str) else list(p.prompt)
        if not tokens:
            raise ApiError("the prompt encodes to no tokens", param="prompt", code="invalid_value")
        ctx = e.target.context_length
        max_tokens = p.max_tokens
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS[p.kind]
            if ctx:
                max_tokens = max(1, min(max_tokens, ctx - len(tokens) - e.spec_k))
        param = "messages" if p.kind == CHAT else "prompt"
        msg = e.check(Request("request", tuple(tokens), max_tokens=max_tokens))
        if msg:
            raise ApiError(msg.replace("request 'request': ", ""), param=param, code="context_length_exceeded")
        need = -(-(len(tokens) + max_tokens + e.spec_k + 1) // e.block_size)
        if e.num_blocks and need > e.num_blocks:  # (mlx-lm's caches grow: None)
            raise ApiError(f"prompt ({len(tokens)} tokens) + max_tokens ({max_tokens}) needs {need} KV blocks; "
                           f"this server has {e.num_blocks} (divergence serve --kv-blocks)", param=param,
                           code="context_length_exceeded")
        return tokens, max_tokens

    async def generate(self, http: HttpRequest, kind: str):
        try:
            body = json.loads(await http.body())
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(f"the body is not valid JSON ({e})", code="invalid_json") from None
        p = parse(body, kind, model_ids=(self.model_id,), top_k=self.engine.top_k)
        tokens, max_tokens = await asyncio.get_running_loop().run_in_executor(self._tokenizing, self.prepare, p)
        rid = self.next_id(kind)
        sink = QueueSink(asyncio.get_running_loop())
        lr = LiveRequest(rid, tuple(tokens), max_tokens, p.sampling, sink,
                         prompt_text=p.prompt if isinstance(p.prompt, str) else None)
        try:
            self.worker.submit(lr)
        except RuntimeError as e:
            raise ApiError(str(e), status=503, kind="server_error", code="unavailable") from None
        try:  # the engine names the trace when it takes the request (at the next step boundary)
            kind, trace = await self._first(http, sink)
        except (ConnectionError, asyncio.CancelledError):
            self.worker.cancel(rid, CANCELLED)
            raise
        if kind != "joined":
            raise ApiError("the engine did not take the request", status=503, kind="server_error",
                           code="unavailable")
        gen = Generation(self, p, rid, len(tokens))
        headers = {"X-Divergence-Request-Id": rid, "X-Divergence-Trace": str(trace)}
        if p.stream:
            return StreamingResponse(self._stream(gen, sink), media_type="text/event-stream", headers=headers)
        return await self._whole(http, gen, sink, headers)

    @staticmethod
    async def _first(http: HttpRequest, sink: QueueSink):
        while True:
            try:
                return await asyncio.wait_for(sink.queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    raise ConnectionError("the client went away") from None

    async def _events(self, gen: Generation, sink: QueueSink, http: HttpRequest | None = None):
        """(text delta, new log-prob entries) per token, until the engine says done; a stop
        string asks the engine to end the request and waits until it has (it is then on disk)."""
        asked_stop = False
        while True:
            if http is None:
                kind, item = await sink.queue.get()
            else:
                try:
                    kind, item = await asyncio.wait_for(sink.queue.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        raise ConnectionError("the client went away")
                    continue
            if kind == "done":
                gen.finish = item
                return
            if gen.detok.stopped:
                continue  # tokens the engine made before it saw the stop: in the trace, not the answer
            n = len(gen.logprobs)
            delta = gen.add(item)
            yield delta, gen.logprobs[n:]
            if gen.detok.stopped and not asked_stop:
                asked_stop = True
                self.worker.cancel(gen.id, STOP)

    def _finish_reason(self, gen: Generation) -> str:
        if gen.detok.stopped:
            return "stop"
        return FINISH.get(gen.finish, gen.finish or "stop")

    async def _whole(self, http, gen: Generation, sink: QueueSink, headers: dict):
        try:
            async for _ in self._events(gen, sink, http):
                pass
        except (ConnectionError, asyncio.CancelledError):
            self.worker.cancel(gen.id, CANCELLED)
            raise
        if gen.finish == "error":
            raise ApiError("the engine failed while serving this request", status=500, kind="server_error",
                           code="engine_error")
        text = gen.detok.text
        choice = {"index": 0, "finish_reason": self._finish_reason(gen),
                  "logprobs": gen.logprobs_json(gen.logprobs)}
        if gen.p.kind == CHAT:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        body = {"id": gen.id, "object": gen.p.kind, "created": int(time.time()), "model": self.model_id,
                "choices": [choice], "usage": gen.usage()}
        return JSONResponse(body, headers=headers)

    async def _stream(self, gen: Generation, sink: QueueSink):
        done = False
        obj = "chat.completion.chunk" if gen.p.kind == CHAT else "text_completion"
        created = int(time.time())

        def chunk(delta: str | None, entries, finish=None, *, role=False) -> str:
            if gen.p.kind == CHAT:
                d = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta else {})
                c = {"index": 0, "delta": d, "finish_reason": finish}
            else:
                c = {"index": 0, "text": delta or "", "finish_reason": finish}
            c["logprobs"] = gen.logprobs_json(entries) if entries else None
            body = {"id": gen.id, "object": obj, "created": created, "model": self.model_id, "choices": [c]}
            if gen.p.include_usage:
                body["usage"] = None
            return f"data: {json.dumps(body)}\n\n"

        try:
            if gen.p.kind == CHAT:
                yield chunk(None, [], role=True)
            async for delta, entries in self._events(gen, sink):
                if delta or entries:
                    yield chunk(delta, entries)
            done = True
            rest = gen.detok.rest() if not gen.detok.stopped else ""
            yield chunk(rest, [], self._finish_reason(gen))
            if gen.p.include_usage:
                body = {"id": gen.id, "object": obj, "created": created, "model": self.model_id, "choices": [],
                        "usage": gen.usage()}
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not done:  # the client went away mid-stream (starlette cancelled us)
                self.worker.cancel(gen.id, CANCELLED)

    # -- the app --------------------------------------------------------------------------------
    def app(self, *, api_key: str | None = None, max_body_bytes: int | None = None) -> Guard:
        """The ASGI app. api_key: required on every route but /health (None: none);
        max_body_bytes: the largest request body (None: default_max_body_bytes)."""
        key = ApiKey(api_key)
        if max_body_bytes is None:
            max_body_bytes = default_max_body_bytes(self.engine.target.context_length)

        async def completions(http):
            return await self._guard(self.generate(http, COMPLETION))

        async def chat(http):
            return await self._guard(self.generate(http, CHAT))

        async def models(http):
            return JSONResponse({"object": "list", "data": [
                {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "divergence"}]})

        async def health(http):  # ready once the engine has its trace open; its path only to a client with the key
            trace = self.worker.current_trace
            shown = str(trace) if trace and key.authorized(http.scope) else None
            return JSONResponse({"status": "ok" if trace else "starting", "trace": shown},
                                status_code=200 if trace else 503)

        return Guard(Starlette(routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ]), key=key, max_body_bytes=max_body_bytes)

    @staticmethod
    async def _guard(coro):
        try:
            return await coro
        except ApiError as e:
            return JSONResponse(e.body(), status_code=e.status)
