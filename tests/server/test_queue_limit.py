"""--max-queued-requests: with requests running and the queue full, a new request
is refused with 503 before any response starts (streaming or not); the
requests already admitted are unaffected."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import Server, start_server, stop_server, wait_for

LIMIT = 64  # waiting places; also the default --max-num-seqs (running slots)
# n=LIMIT sequences of 450 tokens each (prompt + 450 fit max_model_len 512): hundreds
# of batched steps, so the running request holds its slots for the whole test unless
# it is aborted
LONG = {
    "model": "tiny",
    "prompt": "The old lighthouse stood at the end",
    "max_tokens": 450,
    "n": LIMIT,
    "ignore_eos": True,
    "stream": True,
}


@pytest.fixture(scope="module")
def server(tiny_models: dict[str, Path]) -> Iterator[Server]:
    s = start_server(
        tiny_models["qwen3"], "--max-queued-requests", str(LIMIT), "--max-model-len", "512"
    )
    yield s
    stop_server(s)


def _gauge(server: Server, name: str) -> float:
    return server.metrics()[f"vllm:num_requests_{name}"]


def test_queue_full_while_one_request_runs(server: Server) -> None:
    reference = server.greedy()  # the limit is above 0: a lone request is served
    url = f"{server.url}/v1/completions"
    with httpx.stream("POST", url, json=LONG, timeout=120) as running:
        assert running.status_code == 200
        # NOTE: keep the line iterator alive: dropping it would close the connection
        lines = running.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert '"text"' in first  # the first request streams tokens
        wait_for(lambda: _gauge(server, "running") == LIMIT, "the first request to run")
        with httpx.stream("POST", url, json=LONG, timeout=120) as queued:
            assert queued.status_code == 200  # admitted: it waits for the slots
            wait_for(lambda: _gauge(server, "waiting") == LIMIT, "the second request to wait")
            for stream in (True, False):
                r = server.post("/v1/completions", {**LONG, "n": 1, "stream": stream})
                assert r.status_code == 503, (stream, r.text)
                assert r.headers["content-type"].startswith("application/json")
                assert "queue is full" in r.json()["error"]["message"]
            chat = server.post(
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "hi"}], "stream": True},
            )
            assert chat.status_code == 503
            # still full: the first request never finished during the checks
            assert _gauge(server, "waiting") == LIMIT
    wait_for(
        lambda: _gauge(server, "running") == 0 and _gauge(server, "waiting") == 0,
        "the abandoned requests to be aborted",
    )
    assert server.greedy() == reference
