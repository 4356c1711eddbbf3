"""API key (constant-time compare), --protect-metrics, CORS --allowed-origins,
and a graceful shutdown (SIGTERM) with a stream in flight."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import Server, start_server, stop_server

KEY = "sekret-key"
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def server(tiny_models: dict[str, Path]) -> Iterator[Server]:
    s = start_server(
        tiny_models["qwen2"],
        "--api-key", KEY, "--protect-metrics", "--allowed-origins", ORIGIN,
        "--graceful-shutdown-s", "1", "--max-num-seqs", "1", name="keyed",
    )  # fmt: skip
    yield s
    stop_server(s)


def test_api_key(server: Server) -> None:
    reference = server.greedy()
    url = f"{server.url}/v1/completions"
    body = {"prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"authorization": "Bearer " + "x" * len(KEY)}, {"authorization": KEY}):
        r = httpx.post(url, json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in server.client().models.list().data] == ["keyed"]
    assert httpx.get(f"{server.url}/health").status_code == 200  # health needs no key
    assert server.greedy() == reference


def test_protected_metrics(server: Server) -> None:
    assert httpx.get(f"{server.url}/metrics").status_code == 401
    auth = {"authorization": f"Bearer {KEY}"}
    r = httpx.get(f"{server.url}/metrics", headers=auth)
    assert r.status_code == 200 and "vllm:num_requests_running" in r.text


def test_cors_allowed_origins_only(server: Server) -> None:
    def preflight(origin: str) -> httpx.Response:
        headers = {
            "origin": origin,
            "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type",
        }
        return httpx.options(f"{server.url}/v1/completions", headers=headers)

    ok = preflight(ORIGIN)
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == ORIGIN
    bad = preflight("https://evil.example")
    assert "access-control-allow-origin" not in bad.headers
    r = server.post(
        "/v1/completions", {"prompt": "hi", "max_tokens": 1}, headers={"origin": ORIGIN}
    )
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN


def test_sigterm_ends_streams_with_an_error_event(server: Server) -> None:
    """Runs last in this module: it stops the server. One sequence at a time
    (--max-num-seqs 1) makes the n=16 stream thousands of steps long."""
    events: list[str] = []
    started = threading.Event()
    body = {"prompt": "hi", "max_tokens": 250, "n": 16, "ignore_eos": True, "stream": True}

    def stream() -> None:
        headers = {"authorization": f"Bearer {KEY}"}
        url = f"{server.url}/v1/completions"
        with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(120)
    server.proc.send_signal(signal.SIGTERM)
    # while it drains, a new client is answered 503 (not refused)
    seen: list[int] = []
    while not seen or seen[-1] != 503:
        seen.append(httpx.get(f"{server.url}/health", timeout=30).status_code)
    body503 = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "hi"}, timeout=30,
        headers={"authorization": f"Bearer {KEY}"},
    )  # fmt: skip
    assert body503.status_code == 503, body503.text
    t.join(120)
    # not a silent cut: the stream ends with an error event and [DONE]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "shutting down" in error["message"] and error["code"] == 503
    # uvicorn re-raises the signal after its graceful shutdown: exit status -SIGTERM
    assert server.proc.wait(60) in (0, -signal.SIGTERM)
    out = server.proc.stdout.read()
    assert "shutting down" in out
    worker_pid = int(re.search(r"worker process (\d+) ready", out).group(1))
    with pytest.raises(ProcessLookupError):
        os.kill(worker_pid, 0)
