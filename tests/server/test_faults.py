"""Faults below the HTTP layer: the worker process killed mid-stream, an
unexpected error inside an engine step, the engine thread gone. Each must be
visible to the callers (an error, not a quiet end) and to /health, and the
server must serve the same greedy text afterwards."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from pathlib import Path

import httpx
import pytest

from tests.distributed.kill_streams import (
    LONG,
    PROMPT,
    HealthLog,
    kill_during_streams,
    stream_events,
)
from tests.server.conftest import Server, start_server, stop_server, wait_for


def _worker_pid(server: Server) -> int:
    """The server's child process: the worker (read from /proc, Linux)."""
    tasks = Path(f"/proc/{server.proc.pid}/task").iterdir()  # the engine thread spawns it
    children = [c for t in tasks for c in (t / "children").read_text().split()]
    assert len(children) == 1, children
    return int(children[0])


def _errors_counted(server: Server) -> float:
    """vllm:request_success_total{finished_reason="error"}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics").text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:request_success_total" and s.labels["finished_reason"] == "error":
                return s.value
    raise AssertionError("no error series")


def test_worker_killed_mid_stream(server: Server) -> None:
    """On the session's shared server (conftest's `server`): counters are read as
    differences, and the server must serve the same text after the restart."""
    reference = server.greedy()
    errors_before = _errors_counted(server)
    restarts_before = server.metrics().get("laneserve:num_worker_restarts_total", 0)
    old_pid = _worker_pid(server)
    collected: list[httpx.Response] = []

    def running_and_healthy() -> bool:  # 2 streams + 1 collected request, n = 8 each
        running = server.metrics()["vllm:num_requests_running"] == 3 * 8
        return running and httpx.get(f"{server.url}/health").status_code == 200

    also = [lambda: collected.append(server.post("/v1/completions", LONG))]
    health = kill_during_streams(server, old_pid, 2, ready=running_and_healthy, also=also)
    # non-streaming: a 5xx whose body says so
    assert collected[0].status_code >= 500
    assert "died" in collected[0].json()["error"]["message"]
    # the engine restarts by itself (no request needed); health is 503 meanwhile
    wait_for(lambda: 503 in health.seen and health.seen[-1] == 200, "health 503, then 200")
    health.close()
    assert health.seen[0] in (200, 503)
    # healthy until the death is seen, unavailable through the restart, healthy after
    changes = [c for i, c in enumerate(health.seen) if i == 0 or c != health.seen[i - 1]]
    assert changes in ([200, 503, 200], [503, 200]), changes
    assert _worker_pid(server) != old_pid
    assert server.metrics()["laneserve:num_worker_restarts_total"] - restarts_before == 1
    # every failed sample counts as finished with reason "error" (3 requests x n=8),
    # those of the streams included (each stream ended at its first failed sample)
    assert _errors_counted(server) - errors_before == 3 * 8
    assert server.greedy() == reference


@pytest.mark.slow  # a server of its own, stopped for seconds
def test_health_is_503_while_the_worker_makes_no_progress(tiny_models: dict[str, Path]) -> None:
    """A stopped worker (SIGSTOP) with work pending: /health turns 503 once a step
    has run past --health-stall-timeout-s, and 200 again when it runs on."""
    s = start_server(tiny_models["llama"], "--health-stall-timeout-s", "2")
    try:
        events: list[str] = []
        started = threading.Event()
        stream = threading.Thread(target=stream_events, args=(s, events, started))
        stream.start()
        assert started.wait(120), "the stream did not start"
        pid = _worker_pid(s)
        health = HealthLog(s)
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_for(lambda: 503 in health.seen, "health 503 while the worker is stopped")
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: health.seen[-1] == 200, "health 200 once it runs on")
        health.close()
        stream.join(120)
        assert events[-1] == "[DONE]" and "error" not in events[-2]
        assert s.greedy()
    finally:
        stop_server(s)


@pytest.mark.slow  # a server of its own
def test_without_restart_health_says_not_restarted(tiny_models: dict[str, Path]) -> None:
    """--no-restart-worker: after the worker dies, /health stays 503 and says why, and
    requests are refused with the same reason instead of starting a new worker."""
    s = start_server(tiny_models["llama"], "--no-restart-worker")
    try:
        assert s.greedy()
        pid = _worker_pid(s)
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: httpx.get(f"{s.url}/health").status_code == 503, "health 503")
        r = httpx.get(f"{s.url}/health")
        assert r.status_code == 503
        assert r.json() == {"status": "the worker died and was not restarted"}
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
        refused = s.post("/v1/completions", body)
        assert refused.status_code == 503 and "not restarted" in refused.text
        assert httpx.get(f"{s.url}/health").status_code == 503  # still: no restart
        assert s.metrics()["laneserve:num_worker_restarts_total"] == 0
    finally:
        stop_server(s)


# -- in-process: errors inside a step, and a dead engine thread ---------------------
@pytest.fixture(scope="module")
def llm(tiny_models: dict[str, Path]):
    from laneserve.engine_args import EngineArgs
    from laneserve.frontend.async_llm import AsyncLLM

    args = EngineArgs(
        model=str(tiny_models["llama"]), dtype="float32", max_model_len=128, worker_mode="process"
    )
    llm = AsyncLLM(args.create_config())
    llm.start()
    assert llm.wait_ready(300) and llm.load_error is None
    yield llm
    llm.shutdown()


async def _generate(llm, ids: list[int], **params) -> tuple[list[int], str | None]:
    from laneserve.sampling_params import SamplingParams

    tokens, error = [], None
    sp = SamplingParams(temperature=0, ignore_eos=True, **params)
    async for d in llm.generate(os.urandom(8).hex(), ids, sp):
        tokens += d.token_ids
        error = d.state.error or error
    return tokens, error


def test_unexpected_error_in_a_step_fails_its_requests_only(llm) -> None:
    ids = [5, 6, 7, 8, 9]
    reference, _ = asyncio.run(_generate(llm, ids, max_tokens=10))
    core = llm.engine.core
    scheduler = core.scheduler  # NOTE: replaced by the restart, and the fault with it

    def broken(result):
        raise OverflowError("a value the step cannot hold")

    scheduler.update_from_output = broken
    tokens, error = asyncio.run(_generate(llm, ids, max_tokens=10))
    assert error is not None and "internal error" in error and "OverflowError" in error
    assert tokens == []
    # NOTE: the restart runs on the engine thread after the failed outputs went out
    wait_for(
        lambda: llm.healthy and core.num_worker_restarts >= 1 and core.scheduler is not scheduler,
        "the worker to be restarted",
    )
    assert llm.running
    assert asyncio.run(_generate(llm, ids, max_tokens=10))[0] == reference


def test_params_that_cannot_cross_to_the_worker_are_refused(llm) -> None:
    from laneserve.sampling_params import SamplingParams

    ids = [5, 6, 7, 8, 9]
    reference, _ = asyncio.run(_generate(llm, ids, max_tokens=10))
    bad = SamplingParams(max_tokens=4)
    bad.stop = ["\ud800"]  # past the constructor's checks: the engine's own must hold
    with pytest.raises(ValueError, match="cannot be sent to the worker"):
        llm.engine.check_request(ids, bad)
    with pytest.raises(ValueError, match="valid Unicode"):
        SamplingParams(stop="\ud800")
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**70)
    # the largest seed is served, its n children's seeds included
    tokens, error = asyncio.run(_generate(llm, ids, max_tokens=3, n=2, seed=2**63 - 1))
    assert error is None and len(tokens) == 6
    assert asyncio.run(_generate(llm, ids, max_tokens=10))[0] == reference


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_health_sees_a_dead_engine_thread(tiny_models: dict[str, Path]) -> None:
    from fastapi.testclient import TestClient

    from laneserve.engine_args import EngineArgs
    from laneserve.entrypoints.api_server import ServerState, build_app
    from laneserve.frontend.async_llm import AsyncLLM

    args = EngineArgs(model=str(tiny_models["llama"]), dtype="float32", max_model_len=64)
    llm = AsyncLLM(args.create_config())
    llm.start()
    assert llm.wait_ready(300)
    with TestClient(build_app(ServerState(llm, "tiny"))) as client:
        assert client.get("/health").status_code == 200

        def die() -> bool:
            raise SystemExit("a bug outside any step")

        llm._loop_once = die  # the next loop turn ends the thread
        llm.abort("wake-up")
        llm._thread.join(60)
        r = client.get("/health")
        assert r.status_code == 503 and "engine loop stopped" in r.json()["status"]
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503
