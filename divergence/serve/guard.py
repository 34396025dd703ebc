"""What `divergence serve` lets in before a handler runs: the API key and the body's size.

`Guard` is an ASGI middleware in front of the app. With a key, every route but /health
needs `Authorization: Bearer KEY` (vLLM's --api-key guards every /v1 route, /v1/models
included, and leaves health open; here an unknown path needs the key too, so nothing
answers differently with and without it): else 401 with an OpenAI-style body. The key is
compared as SHA-256 digests with hmac.compare_digest: constant time, and its length is not
revealed either.

A body past `max_body_bytes` is 413: at once where Content-Length says so (nothing of it
read; uvicorn discards the rest as it arrives, so the client still reads the answer), else
(a chunked body) when the bytes received pass the bound, counted as they arrive: a
handler never holds more than the bound.
"""
from __future__ import annotations

import hashlib
import hmac
import json

from .openai_schema import ApiError

OPEN_PATHS = frozenset({"/health"})
API_KEY_ENV = "DIVERGENCE_API_KEY"
MIN_MAX_BODY_BYTES = 4 << 20  # the default bound's floor: 4 MiB
BODY_BYTES_PER_TOKEN = 8  # the default bound's room per context token: a token id in JSON ("151935, ") or its text


def default_max_body_bytes(context_length: int | None) -> int:
    """4 MiB, or 8 bytes per token of the model's context where that is more: room for a
    prompt that fills the context, as text or as token ids."""
    return max(MIN_MAX_BODY_BYTES, BODY_BYTES_PER_TOKEN * int(context_length or 0))


def check_api_key(key: str) -> str | None:
    """Why `key` cannot be an API key (it must fit in one header line), or None."""
    if not key:
        return "the API key is empty"
    if any(c.isspace() or not c.isprintable() or ord(c) > 126 for c in key):
        return "the API key must be printable ASCII without spaces (it travels in an HTTP header)"
    return None


class BodyTooLarge(ApiError):
    def __init__(self, limit: int):
        super().__init__(f"the request body is larger than this server takes ({limit} bytes; divergence serve "
                         f"--max-body-bytes)", status=413, code="request_too_large")


class Unauthorized(ApiError):
    def __init__(self, given: bool):
        super().__init__("incorrect API key" if given else "no API key: send the header 'Authorization: Bearer "
                         "KEY' (this server was started with an API key)", status=401, code="invalid_api_key")


class ApiKey:
    """The key a server requires (None: none). `authorized(scope)`: the request carries it."""

    def __init__(self, key: str | None):
        self._digest = hashlib.sha256(key.encode()).digest() if key is not None else None

    @property
    def required(self) -> bool:
        return self._digest is not None

    def presented(self, scope) -> bytes | None:
        """The token of the request's first Authorization header, if it is a Bearer one."""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.strip().partition(b" ")
                return token.strip() if scheme.lower() == b"bearer" else None
        return None

    def authorized(self, scope) -> bool:
        if self._digest is None:
            return True
        token = self.presented(scope)
        return token is not None and hmac.compare_digest(hashlib.sha256(token).digest(), self._digest)


class Guard:
    """ASGI middleware: the key (401), then the body's size (413), then `app`."""

    def __init__(self, app, *, key: ApiKey, max_body_bytes: int):
        self.app, self.key, self.max_body_bytes = app, key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.key.required and scope["path"] not in OPEN_PATHS and not self.key.authorized(scope):
            given = any(name == b"authorization" for name, _ in scope.get("headers", ()))
            return await _answer(send, Unauthorized(given), [(b"www-authenticate", b"Bearer")])
        length = _content_length(scope)
        if length is not None and length > self.max_body_bytes:
            return await _answer(send, BodyTooLarge(self.max_body_bytes))
        await self.app(scope, self._bounded(receive), send)

    def _bounded(self, receive):
        """receive, raising BodyTooLarge (an ApiError: the handler answers it) once the body's
        bytes so far pass the bound."""
        limit, seen = self.max_body_bytes, 0

        async def bounded():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message
        return bounded


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:  # (h11 refuses a malformed one before the app runs)
                return None
    return None


async def _answer(send, error: ApiError, headers=()) -> None:
    body = json.dumps(error.body(), separators=(",", ":")).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})
