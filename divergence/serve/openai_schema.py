"""OpenAI request bodies -> what the engine runs; every refusal an `ApiError` (HTTP 400).

Only what this engine does is accepted: one prompt and one choice a request (n = 1),
`max_tokens`, `temperature`, `top_p`, `seed`, `stop`, `logprobs` / `top_logprobs` up to
the server's recorded top-k, `stream` (+ `stream_options.include_usage`). Unknown
fields are ignored, as OpenAI-compatible servers do. Defaults follow mlx_lm.server:
temperature 0 (greedy). A request without a seed gets one, recorded, so `rerun`
draws the same tokens; any integer seed is taken, as OpenAI's API takes it (Sampling maps it
to the engine's seed space, seed mod 2**63: core.request.engine_seed; docs/prompts.md).
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from ..core.request import Sampling

COMPLETION, CHAT = "text_completion", "chat.completion"
DEFAULT_MAX_TOKENS = {COMPLETION: 16, CHAT: 512}  # chat: capped by what the context leaves
MAX_STOPS = 4


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, the offending parameter, a code."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Parsed:
    """A validated request, before tokenisation (prompt: text or token ids; messages: chat)."""

    kind: str
    model: str
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    max_tokens: int | None = None
    sampling: Sampling = Sampling()
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # top alternatives per token (0: the chosen token's only); None: off


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(body: dict, key: str, *, lo: int | None = None, hi: int | None = None):
    v = body.get(key)
    if v is None:
        return None
    if not _is_int(v):
        raise ApiError(f"'{key}' must be an integer, got {type(v).__name__}", param=key, code="invalid_type")
    if lo is not None and v < lo:
        raise ApiError(f"'{key}' must be >= {lo}, got {v}", param=key, code="invalid_value")
    if hi is not None and v > hi:
        raise ApiError(f"'{key}' must be <= {hi}, got {v}", param=key, code="invalid_value")
    return v


def _bool(body: dict, key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ApiError(f"'{key}' must be a boolean, got {type(v).__name__}", param=key, code="invalid_type")
    return v


def parse(body, kind: str, *, model_ids: tuple[str, ...], top_k: int) -> Parsed:
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object", code="invalid_body")
    model = body.get("model")
    if not isinstance(model, str):
        raise ApiError("'model' is required (a string)", param="model", code="invalid_type")
    if model not in model_ids:
        raise ApiError(f"the model '{model}' does not exist (this server serves {', '.join(model_ids)})",
                       param="model", code="model_not_found")
    p = Parsed(kind, model)
    if kind == COMPLETION:
        p.prompt = _prompt(body.get("prompt"))
        if _bool(body, "echo"):
            raise ApiError("'echo' is not supported", param="echo", code="unsupported")
        lp = _int(body, "logprobs", lo=0, hi=top_k)
        p.logprobs = lp
    else:
        p.messages = _messages(body.get("messages"))
        if _bool(body, "logprobs"):
            p.logprobs = _int(body, "top_logprobs", lo=0, hi=top_k) or 0
        elif body.get("top_logprobs") is not None:
            raise ApiError("'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value")
    key = "max_completion_tokens" if kind == CHAT and body.get("max_completion_tokens") is not None else "max_tokens"
    p.max_tokens = _int(body, key)
    if p.max_tokens is not None and p.max_tokens <= 0:
        raise ApiError(f"'{key}' must be > 0, got {p.max_tokens}", param=key, code="invalid_value")
    n = _int(body, "n")
    if n is not None and n != 1:
        raise ApiError("only n = 1 is supported", param="n", code="unsupported")
    p.sampling = _sampling(body)
    p.stop = _stop(body.get("stop"))
    p.stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise ApiError("'stream_options' must be an object", param="stream_options", code="invalid_type")
        p.include_usage = _bool(opts, "include_usage")
    return p


def _sampling(body: dict) -> Sampling:
    t = body.get("temperature", 0.0)
    if t is None:
        t = 0.0
    if not _is_num(t):
        raise ApiError(f"'temperature' must be a number, got {type(t).__name__}", param="temperature",
                       code="invalid_type")
    if t < 0:
        raise ApiError(f"'temperature' must be >= 0, got {t}", param="temperature", code="invalid_value")
    top_p = body.get("top_p", 1.0)
    if top_p is None:
        top_p = 1.0
    if not _is_num(top_p):
        raise ApiError(f"'top_p' must be a number, got {type(top_p).__name__}", param="top_p", code="invalid_type")
    if not 0 < top_p <= 1:
        raise ApiError(f"'top_p' must be in (0, 1], got {top_p}", param="top_p", code="invalid_value")
    seed = _int(body, "seed")
    if seed is None:
        seed = secrets.randbelow(1 << 31)  # recorded in the trace: a rerun draws the same tokens
    return Sampling(float(t), float(top_p), int(seed))


def _prompt(v) -> str | list[int]:
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]  # a batch of one
    if isinstance(v, str):
        if not v:
            raise ApiError("'prompt' is empty", param="prompt", code="invalid_value")
        return v
    if isinstance(v, list) and v and all(_is_int(t) for t in v):
        return list(v)
    if isinstance(v, list) and len(v) > 1 and all(isinstance(x, (str, list)) for x in v):
        raise ApiError("one prompt per request (send several requests: they are batched)", param="prompt",
                       code="unsupported")
    raise ApiError("'prompt' must be a non-empty string or a list of token ids", param="prompt",
                   code="invalid_type")


def _messages(v) -> list[dict]:
    if not isinstance(v, list) or not v:
        raise ApiError("'messages' must be a non-empty list", param="messages", code="invalid_type")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(f"messages[{i}] must be an object with a string 'role'", param="messages",
                           code="invalid_type")
        c = m.get("content")
        if isinstance(c, list):  # content parts: text only
            if not all(isinstance(x, dict) and x.get("type") == "text" and isinstance(x.get("text"), str) for x in c):
                raise ApiError(f"messages[{i}].content: only text parts are supported", param="messages",
                               code="unsupported")
            c = "".join(x["text"] for x in c)
        if not isinstance(c, str):
            raise ApiError(f"messages[{i}].content must be a string", param="messages", code="invalid_type")
        out.append({"role": m["role"], "content": c})
    return out


def _stop(v) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise ApiError("'stop' must be a non-empty string or a list of them", param="stop", code="invalid_type")
    if len(v) > MAX_STOPS:
        raise ApiError(f"'stop' takes at most {MAX_STOPS} strings", param="stop", code="invalid_value")
    return list(v)
