"""Slow clients are timed out: half-sent headers close the connection, a body
that stops coming is a 408. A real uvicorn on loopback with the server's
protocol and middleware, their bounds shortened so the test is quick."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from laneserve.entrypoints.middleware import GuardMiddleware
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
