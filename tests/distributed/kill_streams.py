"""A worker or rank killed while streams decode: every stream must end with the worker's
error, and /health must show it."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable, Sequence

import httpx

from tests.server.conftest import Server, wait_for

PROMPT = "The old lighthouse stood at the end"
# prompt + max_tokens must fit max_model_len 256 (else a 400)
LONG = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "n": 8, "ignore_eos": True}


class HealthLog:
    """Records every /health status from a background poller."""

    def __init__(self, server: Server) -> None:
        self.url, self.seen, self.stop = f"{server.url}/health", [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.seen.append(httpx.get(self.url, timeout=30).status_code)
            except httpx.HTTPError:
                self.seen.append(0)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def stream_events(
    server: Server, out: list[str], started: threading.Event, body: dict = LONG
) -> None:
    """One streaming completion; each `data:` payload goes to `out` (`started` at the first)."""
    body = {**body, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(line.removeprefix("data: "))
                started.set()


def kill_during_streams(
    server: Server,
    pid: int,
    streams: int,
    body: dict = LONG,
    ready: Callable[[], bool] | None = None,
    also: Sequence[Callable[[], object]] = (),
) -> HealthLog:
    """Start `streams` streaming requests (and the `also` calls, each on its own thread),
    wait for each stream's first event (and `ready`), SIGKILL `pid`, and check that every
    stream ends with a "worker ... died" server error event, never a normal finish.
    Returns the /health log, started just before the kill."""
    events: list[list[str]] = [[] for _ in range(streams)]
    started = [threading.Event() for _ in range(streams)]
    threads = [
        threading.Thread(target=stream_events, args=(server, events[i], started[i], body))
        for i in range(streams)
    ] + [threading.Thread(target=call) for call in also]
    for t in threads:
        t.start()
    for ev in started:
        assert ev.wait(120), "the streams did not start"
    if ready is not None:
        wait_for(ready, "the streams running")
    health = HealthLog(server)
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(120)
    for ev in events:
        assert ev[-1] == "[DONE]"
        error = json.loads(ev[-2])["error"]
        assert "worker" in error["message"] and "died" in error["message"], error
        assert error["code"] >= 500
        assert not any('"finish_reason": "length"' in e for e in ev)
    return health
