"""`laneserve serve --data-parallel-size 2` end to end: concurrent greedy streams give
the text one rank's server gives, both ranks serve (per-engine metrics), and killing one
rank's worker process fails the streams it served while the other rank's complete;
/health is 503 through that rank's restart, then 200."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.distributed.kill_streams import HealthLog
from tests.server.conftest import Server, start_server, stop_server, wait_for

pytestmark = pytest.mark.slow  # a server of its own, with two worker processes

PROMPTS = [
    "The old lighthouse stood at the end",
    "Once upon a time there was",
    "In the beginning the river",
    "My favourite colour is",
    "The quick brown fox",
    "Numbers: one, two,",
]


@pytest.fixture(scope="module")
def dp_server(tiny_models: dict[str, Path]) -> Iterator[Server]:
    s = start_server(tiny_models["llama"], "--data-parallel-size", "2")
    yield s
    stop_server(s)


def labelled(server: Server, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample of `name`, by its labels other than model_name."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text):
        for s in family.samples:
            if s.name == name:
                key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                out[key] = s.value
    return out


def per_engine(server: Server, name: str, **labels: str) -> list[float]:
    samples = labelled(server, name)
    return [samples.get(tuple(sorted({"engine": str(e), **labels}.items())), 0.0) for e in (0, 1)]


def stream(server: Server, prompt: str, max_tokens: int, out: dict, started: threading.Event):
    """One streamed greedy completion: its text, finish reason or error."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    out.update(text="", finish=None, error=None)
    url = f"{server.url}/v1/completions"
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                out["error"] = event["error"]
                continue
            choice = event["choices"][0]
            out["text"] += choice["text"]
            out["finish"] = choice["finish_reason"] or out["finish"]
            started.set()


def run_streams(server: Server, max_tokens: int) -> tuple[list[dict], list[threading.Thread]]:
    outs: list[dict] = [{} for _ in PROMPTS]
    started = [threading.Event() for _ in PROMPTS]
    threads = [
        threading.Thread(target=stream, args=(server, p, max_tokens, outs[i], started[i]))
        for i, p in enumerate(PROMPTS)
    ]
    for t in threads:
        t.start()
    for ev in started:
        assert ev.wait(120), "a stream did not start"
    return outs, threads


def worker_pids(server: Server) -> list[int]:
    """The server's child processes: one worker per rank (read from /proc, Linux)."""
    tasks = Path(f"/proc/{server.proc.pid}/task").iterdir()
    return [int(c) for t in tasks for c in (t / "children").read_text().split()]


def test_streams_equal_one_rank_and_both_ranks_serve(dp_server: Server, server: Server) -> None:
    want = [server.greedy(p) for p in PROMPTS]  # the shared one-rank server
    assert len(worker_pids(dp_server)) == 2
    outs, threads = run_streams(dp_server, 12)
    for t in threads:
        t.join(120)
    assert [o["text"] for o in outs] == want
    assert all(o["finish"] == "length" and o["error"] is None for o in outs)
    done = per_engine(dp_server, "vllm:request_success_total", finished_reason="length")
    assert sum(done) == len(PROMPTS) and min(done) >= 1, done
    assert min(per_engine(dp_server, "vllm:generation_tokens_total")) >= 12


def completion(server: Server, prompt: str, max_tokens: int) -> str:
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_killed_rank_fails_its_streams_only_and_restarts(dp_server: Server, server: Server) -> None:
    want = [completion(server, p, 200) for p in PROMPTS]  # the shared one-rank server
    pids = worker_pids(dp_server)
    assert len(pids) == 2
    errors_before = sum(
        per_engine(dp_server, "vllm:request_success_total", finished_reason="error")
    )
    outs, threads = run_streams(dp_server, 200)
    health = HealthLog(dp_server)
    os.kill(pids[1], signal.SIGKILL)
    for t in threads:
        t.join(120)
    failed = [o for o in outs if o["error"] is not None]
    served = [(o, w) for o, w in zip(outs, want, strict=True) if o["error"] is None]
    # the killed rank's streams end with an error that says so; the others run to the end
    assert failed and served, outs
    for o in failed:
        assert "died" in o["error"]["message"] and o["error"]["code"] >= 500, o
        assert o["finish"] is None
    assert all(o["finish"] == "length" and o["text"] == w for o, w in served)
    wait_for(lambda: 503 in health.seen and health.seen[-1] == 200, "health 503, then 200")
    health.close()
    restarts = per_engine(dp_server, "laneserve:num_worker_restarts_total")
    assert sorted(restarts) == [0, 1], restarts
    dead_rank = restarts.index(1)
    errors = per_engine(dp_server, "vllm:request_success_total", finished_reason="error")
    assert sum(errors) - errors_before == len(failed) and errors[1 - dead_rank] == 0
    new = worker_pids(dp_server)
    assert len(new) == 2 and pids[0] in new and pids[1] not in new
    # both ranks serve again, with the same text: the restarted one included
    before = per_engine(dp_server, "vllm:request_success_total", finished_reason="length")
    outs, threads = run_streams(dp_server, 200)
    for t in threads:
        t.join(120)
    assert [o["text"] for o in outs] == want
    after = per_engine(dp_server, "vllm:request_success_total", finished_reason="length")
    assert after[dead_rank] > before[dead_rank]
