"""A rank killed while streams decode: every stream must end with the worker's error."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable

from tests.server.conftest import Server, wait_for
from tests.server.test_faults import HealthLog, _stream_events


def kill_during_streams(
    server: Server, pid: int, streams: int, body: dict, ready: Callable[[], bool] | None = None
) -> HealthLog:
    """Start `streams` streaming requests, wait for each one's first event (and `ready`),
    SIGKILL `pid`, and check that every stream ends with a "worker ... died" error event.
    Returns the /health log, started just before the kill."""
    events: list[list[str]] = [[] for _ in range(streams)]
    started = [threading.Event() for _ in range(streams)]
    threads = [
        threading.Thread(target=_stream_events, args=(server, events[i], started[i], body))
        for i in range(streams)
    ]
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
        assert not any('"finish_reason": "length"' in e for e in ev)
    return health
