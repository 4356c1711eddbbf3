"""Slow clients are timed out: half-sent headers close the connection, a body
that stops coming is a 408, and an oversized upload still gets its whole 413. A real uvicorn on loopback with the server's
protocol and middleware, their bounds shortened so the test is quick."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from laneserve.entrypoints.middleware import GuardMiddleware, drain
from laneserve.entrypoints.slow_clients import HeaderTimeoutProtocol
from tests.server.conftest import free_port


class QuickHeaders(HeaderTimeoutProtocol):
    header_timeout_s = 0.5


async def echo(scope, receive, send) -> None:  # a plain ASGI app: 200 with the body size
    if scope["type"] != "http":
        return
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    body = str(size).encode()
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    app = GuardMiddleware(echo, None, 1 << 20, frozenset(), body_timeout_s=0.5)
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, http=QuickHeaders, log_level="error")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield port
    server.should_exit = True
    thread.join(10)


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=20)
    return s


def _read_all(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(4096):
        out += chunk
    return out


def test_half_sent_headers_are_closed(port: int) -> None:
    with _connect(port) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\n")  # never finished
        assert _read_all(s) == b""  # closed by the server (a hang would time the recv out)


def test_a_body_that_stops_coming_is_408(port: int) -> None:
    with _connect(port) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789")
        reply = _read_all(s)
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert b"did not arrive" in reply


def test_a_prompt_client_is_served_and_kept_alive(port: int) -> None:
    with _connect(port) as s:
        for _ in range(2):  # the second request on the same connection
            s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
            reply = s.recv(4096)
            while not reply.endswith(b"\r\n\r\n3"):
                reply += s.recv(4096)
            assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"3"), reply


def _upload(s: socket.socket, head: bytes, body_bytes: int, tail: bytes) -> None:
    """Send the request head, the whole body, then `tail` (a reset mid-way is the failure
    the caller sees as a missing reply)."""
    try:
        s.sendall(head)
        chunk = b"a" * 65536
        for _ in range(body_bytes // len(chunk)):
            s.sendall(chunk)
        s.sendall(tail)
    except OSError:
        pass


@pytest.mark.parametrize("declared", [True, False])
def test_an_oversized_upload_gets_the_whole_413(port: int, declared: bool) -> None:
    """The 413 reaches a client still sending its body (with Content-Length, or chunked
    past the limit): the server reads the rest before it replies and closes, since a
    close with unread bytes resets the connection and can destroy the reply."""
    size = 4 << 20  # four times the module's 1 MiB limit
    if declared:
        head, tail = f"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\n\r\n", b""
    else:  # one chunk of the whole size: the limit is passed while reading it
        head = f"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n{size:x}\r\n"
        tail = b"\r\n0\r\n\r\n"
    for _ in range(5):
        with _connect(port) as s:
            sender = threading.Thread(target=_upload, args=(s, head.encode(), size, tail))
            sender.start()
            reply = _read_all(s)
            sender.join(20)
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        assert reply.endswith(b"}"), reply[-200:]  # the whole JSON body came
        assert b"exceeds the limit" in reply


def test_drain_stops_at_its_bounds() -> None:
    async def endless() -> dict:
        return {"type": "http.request", "body": b"x" * 1000, "more_body": True}

    async def silent() -> dict:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    async def gone() -> dict:
        return {"type": "http.disconnect"}

    assert 10_000 < asyncio.run(drain(endless, max_bytes=10_000, timeout_s=30)) <= 11_000
    start = time.monotonic()
    assert asyncio.run(drain(silent, max_bytes=10_000, timeout_s=0.2)) == 0
    assert time.monotonic() - start < 5
    assert asyncio.run(drain(gone)) == 0
