"""HTTP guards as plain ASGI middleware: API key, body-size limit, CORS.

Plain ASGI (not Starlette's `BaseHTTPMiddleware`) so that the endpoint sees the
server's own `receive` channel: a client that leaves shows up there as
`http.disconnect`, which is how abandoned requests are aborted. The body-size
limit counts the bytes actually read, so a chunked body without
Content-Length cannot slip past it; a body within the limit is buffered and
handed on unchanged.

A refused request's body is read and dropped (up to `DRAIN_BYTES`, for at most
`DRAIN_S`) before the refusal goes out: the server closes the connection after it, and
closing a socket with unread bytes resets it, which can destroy the refusal on its way
to a client that is still sending (an oversized upload would see "connection reset"
instead of the 413).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

BODY_TIMEOUT_S = 30.0  # from complete headers to the whole body: else a 408
DRAIN_BYTES = 64 * 2**20  # a refused request's body read (and dropped) before the reply
DRAIN_S = 5.0  # ... for at most this long


class GuardMiddleware:
    """401 without the API key (outside `open_paths`), 413 for bodies over the limit,
    408 for a body that does not arrive within `body_timeout_s`."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_request_bytes: int,
        open_paths: frozenset[str],
        body_timeout_s: float = BODY_TIMEOUT_S,
    ) -> None:
        self.app = app
        self.body_timeout_s = body_timeout_s
        self.expected = f"Bearer {api_key}".encode() if api_key is not None else None
        self.max_bytes = max_request_bytes
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        if not self._authorized(scope, headers):
            await drain(receive)
            await _error(send, 401, "invalid or missing API key", "AuthenticationError")
            return
        size = headers.get(b"content-length", b"")
        if size.isdigit() and int(size) > self.max_bytes:
            await drain(receive)
            await self._too_large(send, f"{int(size)} bytes")
            return
        try:
            async with asyncio.timeout(self.body_timeout_s):
                body = await self._read_body(receive)
        except TimeoutError:
            msg = f"the request body did not arrive within {self.body_timeout_s:g} s"
            await _error(send, 408, msg, "RequestTimeoutError")
            return
        if body is None:
            await drain(receive)
            await self._too_large(send, f"more than {self.max_bytes} bytes")
            return
        await self.app(scope, _replay(body, receive), send)

    def _authorized(self, scope: Scope, headers: dict[bytes, bytes]) -> bool:
        if self.expected is None or scope.get("path") in self.open_paths:
            return True
        if scope.get("method") == "OPTIONS":  # CORS preflight carries no credentials
            return True
        given = headers.get(b"authorization", b"")
        return hmac.compare_digest(given, self.expected)  # NOTE: constant time

    async def _read_body(self, receive: Receive) -> list[Message] | None:
        """The request's body messages, or None once they pass the limit."""
        messages: list[Message] = []
        total = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages  # a disconnect: the endpoint will see it
            total += len(message.get("body", b""))
            if total > self.max_bytes:
                return None
            if not message.get("more_body", False):
                return messages

    async def _too_large(self, send: Send, what: str) -> None:
        msg = f"the request body ({what}) exceeds the limit of {self.max_bytes} bytes"
        await _error(send, 413, msg, "RequestTooLargeError")


async def drain(receive: Receive, max_bytes: int = DRAIN_BYTES, timeout_s: float = DRAIN_S) -> int:
    """Read and drop the rest of a request's body, up to `max_bytes` or `timeout_s`
    (whichever comes first); the bytes read."""
    total = 0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            while total <= max_bytes:
                message = await receive()
                if message["type"] != "http.request":
                    break  # the client left
                total += len(message.get("body", b""))
                if not message.get("more_body", False):
                    break
    return total


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """`receive` that hands out the buffered body first, then the live channel."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed


def error_json(message: str, kind: str, status: int, param: str | None = None) -> bytes:
    """An OpenAI error body; ASCII-escaped so that any message can be encoded."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return json.dumps(body, ensure_ascii=True).encode()


async def _error(send: Send, status: int, message: str, kind: str) -> None:
    body = error_json(message, kind, status)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
