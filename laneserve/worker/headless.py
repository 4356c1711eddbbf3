"""`laneserve serve --headless`: a machine that only runs ranks of a model whose engine
runs on node 0 (docs/distributed.md).

Node k starts its ranks (k*L .. k*L+L-1): tensor-parallel ranks, which join node 0's
group at `--master-addr:--master-port` and follow rank 0's commands; or, with the
data-parallel ranks spread over the nodes, those ranks' workers, which meet the engine's
store there and take their commands from it (worker/remote_worker.py). When they end
(rank 0 or the engine went away: the head stopped or restarts its workers; or one of
them died), the node starts them again after a short pause, so they rejoin: a restarted
worker on node 0 (or engine) finds every node's ranks waiting for it. A rank whose flags differ from node 0's
ends the node (exit 2): starting it again would not help.
"""

from __future__ import annotations

import logging
import threading
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

from laneserve.config import EngineConfig
from laneserve.worker.rank_steps import BAD_FLAGS_EXIT
from laneserve.worker.ranks import FollowerMain, spawn_follower

log = logging.getLogger(__name__)

RESPAWN_S = 2.0  # pause before the ranks start again: the old rank 0 has time to end


def run_headless(
    config: EngineConfig, ranks: range, target: FollowerMain, stop: threading.Event
) -> int:
    """Run this node's ranks (`target(config bytes, rank, ...)` each) until `stop` is set;
    0, or 2 when node 0 refused our flags."""
    p = config.parallel
    while not stop.is_set():
        procs = [
            spawn_follower(config, r, p.master_addr, p.master_port, target, with_pipe=False)[0]
            for r in ranks
        ]
        log.info(
            "node %d: ranks %s joining %s:%d",
            p.node_rank,
            list(ranks),
            p.master_addr,
            p.master_port,
        )
        _wait_any(procs, stop)
        codes = _end(procs)
        if stop.is_set():
            break
        if BAD_FLAGS_EXIT in codes:
            log.error("node %d: node 0 runs another model or other flags; stopping", p.node_rank)
            return BAD_FLAGS_EXIT
        log.warning(
            "node %d: ranks ended (exit codes %s); starting them again to rejoin rank 0",
            p.node_rank,
            codes,
        )
        stop.wait(RESPAWN_S)
    return 0


def _wait_any(procs: list[BaseProcess], stop: threading.Event) -> None:
    while not stop.is_set() and all(proc.is_alive() for proc in procs):
        wait([proc.sentinel for proc in procs], timeout=0.5)


def _end(procs: list[BaseProcess]) -> list[int | None]:
    """Every rank of this node ends with the first (the group is broken either way)."""
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(10)
    return [proc.exitcode for proc in procs]
