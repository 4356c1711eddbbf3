"""`laneserve serve --tensor-parallel-size 2`: rank 1 killed (SIGKILL) while four
streams decode: each stream ends with an error event, /health goes 503, then 200 once
every rank is back, and the server answers as before."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.distributed.kill_streams import kill_during_streams
from tests.distributed.test_tp_engine import _rank_pids
from tests.server.conftest import start_server, stop_server, wait_for
from tests.server.test_faults import _worker_pid

STREAM = {"model": "tiny", "prompt": "The old lighthouse", "max_tokens": 200, "ignore_eos": True}


@pytest.mark.slow  # a two-rank server of its own
def test_a_killed_rank_fails_the_streams_then_every_rank_restarts(
    tiny_models: dict[str, Path],
) -> None:
    s = start_server(tiny_models["llama"], "--tensor-parallel-size", "2")
    try:
        reference = s.greedy()
        worker = _worker_pid(s)
        (rank1,) = _rank_pids(worker)
        health = kill_during_streams(
            s, rank1, 4, STREAM, ready=lambda: s.metrics()["vllm:num_requests_running"] == 4
        )
        wait_for(lambda: 503 in health.seen and health.seen[-1] == 200, "health 503, then 200")
        health.close()
        changes = [c for i, c in enumerate(health.seen) if i == 0 or c != health.seen[i - 1]]
        assert changes in ([200, 503, 200], [503, 200]), changes
        new_worker = _worker_pid(s)
        assert new_worker != worker and len(_rank_pids(new_worker)) == 1
        assert s.greedy() == reference
        assert httpx.get(f"{s.url}/health").status_code == 200
    finally:
        stop_server(s)
