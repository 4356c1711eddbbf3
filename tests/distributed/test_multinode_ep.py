"""Data-parallel ranks with expert parallelism on two "machines": two launches on
127.0.0.1, node 0 serving the API with DP rank 0's worker (`--nnodes 2 --node-rank 0`)
and node 1 running DP rank 1's worker only (`--headless`), which takes its commands from
the engine over a gloo channel (laneserve/remote_client.py).

Concurrent greedy streams give one device's text (MTP k = 2 on, as on one machine);
killing node 1's worker or node 0's fails every stream (both ranks'), /health goes 503
and comes back once both ranks restarted; an idle kill is seen with no step running; node 1
gone altogether keeps the server 503 until it is started again; a node started with
other flags is refused on both sides."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from tests.distributed.kill_streams import HealthLog
from tests.distributed.test_multinode import (
    end,
    headless,
    node_rank_pid,
    node_rank_pids,
    refused_on_both_sides,
)
from tests.server.conftest import Server, free_port, start_server, stop_server, wait_for
from tests.server.test_data_parallel_serve import labelled, per_engine, run_streams, worker_pids
from tests.server.test_expert_parallel_serve import SPEC, deepseek, one_device

__all__ = ["deepseek"]  # the module-scoped checkpoint fixture

pytestmark = pytest.mark.slow  # two launches, two workers, restarts

DP2 = ("--data-parallel-size", "2", "--enable-expert-parallel", "--speculative-config", SPEC)


def _head(model: Path, port: int) -> Server:
    return start_server(model, *DP2, "--nnodes", "2", "--master-port", str(port))


def _streams_equal(head: Server, want: list[str]) -> None:
    outs, threads = run_streams(head, 40)
    for t in threads:
        t.join(120)
    assert [o["text"] for o in outs] == want
    assert all(o["finish"] == "length" and o["error"] is None for o in outs)


def _kill_during_streams(head: Server, pid: int) -> None:
    """SIGKILL `pid` while streams decode on both ranks: every stream ends with an error,
    /health goes 503, then 200 once both ranks restarted."""
    outs, threads = run_streams(head, 200)
    health = HealthLog(head)
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(120)
    for o in outs:  # its rank's worker died, or its rank waited on the one that did
        assert o["error"] is not None and o["error"]["code"] >= 500, o
        assert "died" in o["error"]["message"] and o["finish"] is None
    wait_for(lambda: 503 in health.seen and health.seen[-1] == 200, "health 503, then 200")
    health.close()


def test_two_nodes_serve_one_devices_text_and_restart_after_a_death(deepseek: Path) -> None:
    want = one_device(deepseek, 40)
    port = free_port()
    nodes = [headless(deepseek, port, sizes=DP2)]
    head = None
    try:
        head = _head(deepseek, port)
        assert len(worker_pids(head)) == 1  # node 0 runs rank 0's worker only
        _streams_equal(head, want)
        assert min(per_engine(head, "vllm:generation_tokens_total")) >= 40  # both ranks served

        remote = node_rank_pid(nodes[0])  # node 1's worker
        _kill_during_streams(head, remote)
        assert node_rank_pid(nodes[0]) != remote  # node 1 started its worker again
        _streams_equal(head, want)

        local = worker_pids(head)[0]  # node 0's worker: node 1's restarts with it
        remote = node_rank_pid(nodes[0])
        _kill_during_streams(head, local)
        assert worker_pids(head) != [local] and node_rank_pid(nodes[0]) != remote
        _streams_equal(head, want)

        remote = node_rank_pid(nodes[0])  # killed while idle: the channel's reader sees it
        health = HealthLog(head)
        os.kill(remote, signal.SIGKILL)
        wait_for(lambda: 503 in health.seen and health.seen[-1] == 200, "idle: 503, then 200")
        health.close()
        _streams_equal(head, want)

        remote = node_rank_pid(nodes[0])  # node 1 gone (its launch and its worker) ...
        health = HealthLog(head)
        nodes[0].kill()
        os.kill(remote, signal.SIGKILL)
        wait_for(lambda: 503 in health.seen, "health 503 with node 1 gone")
        assert "restarting" in httpx.get(f"{head.url}/health").text
        nodes.append(headless(deepseek, port, sizes=DP2))  # ... and started again
        wait_for(lambda: health.seen[-1] == 200, "health 200 with node 1 back")
        health.close()
        _streams_equal(head, want)
    finally:
        if head is not None:
            stop_server(head)
        out = [end(node) for node in nodes]
    assert "ranks [1] joining 127.0.0.1" in out[-1]


def test_a_node_with_other_flags_is_refused(deepseek: Path) -> None:
    says = "other flags than node 0"
    refused_on_both_sides(deepseek, _head, DP2, says, says)


def test_four_ranks_over_two_nodes_run_two_workers_each(deepseek: Path) -> None:
    """L = 2: node 0 runs ranks 0, 1 (two local workers), node 1 ranks 2, 3 (experts
    4..5 and 6..7 of 8); the text is one device's and every rank serves; one of node 1's
    workers killed restarts all four."""
    want = one_device(deepseek, 40)
    d4 = ("--data-parallel-size", "4", *DP2[2:])
    port = free_port()
    node1 = headless(deepseek, port, sizes=d4)
    head = None
    try:
        head = start_server(deepseek, *d4, "--nnodes", "2", "--master-port", str(port))
        assert len(worker_pids(head)) == 2
        _streams_equal(head, want)
        tokens = labelled(head, "vllm:generation_tokens_total")
        served = {dict(labels)["engine"]: n for labels, n in tokens.items()}
        assert sorted(served) == ["0", "1", "2", "3"] and min(served.values()) >= 40
        local, remote = worker_pids(head), node_rank_pids(node1)
        assert len(remote) == 2
        _kill_during_streams(head, remote[1])
        wait_for(lambda: len(node_rank_pids(node1)) == 2, "node 1's two workers")
        assert not set(worker_pids(head)) & set(local)
        assert not set(node_rank_pids(node1)) & set(remote)
        _streams_equal(head, want)
    finally:
        if head is not None:
            stop_server(head)
        out = end(node1)
    assert "ranks [2, 3] joining" in out and "routed experts 6..7 of each MoE layer" in out
