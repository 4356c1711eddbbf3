"""Data-parallel ranks in lock step, for expert parallelism.

With the routed experts divided over the ranks, every MoE layer of every step is an
exchange between all the ranks' workers, so every worker must run every step:

```
 round:   rank 0 ── step n (its requests) ─┐
          rank 1 ── step n (empty)        ─┴─ each worker: forward, and its exchanges
                                              (an empty step: the exchanges only)
 collect: the results that are ready, from whichever ranks have one
```
A round is sent when every rank has fewer than `depth` steps in flight and some rank
has work to schedule; a rank with nothing to run gets an empty step. So every worker
receives the same number of steps, in the same order. Async depth 2, the lanes and the
ping-pong slots run per rank as without lock step.

A worker's death ends the group (the others would wait in an exchange): every rank's
requests fail, and the ranks restart together, meeting at a new port.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import msgspec

from laneserve.config import EngineConfig
from laneserve.core.data_parallel import DataParallelCore, ready_ranks
from laneserve.core.engine_core import EngineCore
from laneserve.core.scheduler import EngineCoreOutput
from laneserve.distributed.ports import free_port

log = logging.getLogger(__name__)

PEER_DIED = "another expert-parallel rank's worker died (the ranks restart together)"


def with_rank(config: EngineConfig, rank: int, port: int) -> EngineConfig:
    """A rank's worker config: its index and the port where the ranks' group meets."""
    parallel = msgspec.structs.replace(
        config.parallel, data_parallel_rank=rank, data_parallel_master_port=port
    )
    return msgspec.structs.replace(config, parallel=parallel)


class LockstepCore(DataParallelCore):
    """`DataParallelCore` whose ranks step together (expert parallelism)."""

    def step(self) -> list[EngineCoreOutput]:
        if self.restart_pending:
            return self.restart_worker()
        outs: list[EngineCoreOutput] = []
        while self._round_open():
            cmds = [r.plan() for r in self.ranks]
            if all(c is None for c in cmds):
                break
            for rank, cmd in zip(self.ranks, cmds, strict=True):
                step = cmd if cmd is not None else rank.plan(force=True)
                assert step is not None, "a forced plan is a step"
                outs += rank.send(step)
            if self.restart_pending:
                return outs + self._fail_the_others()
        busy = [r for r in self.ranks if r.scheduler.num_in_flight]
        if busy:
            for rank in ready_ranks(busy):
                outs += rank.collect()
        if self.restart_pending:
            outs += self._fail_the_others()
        return outs

    def _round_open(self) -> bool:
        ranks = self.ranks
        if not all(r.healthy for r in ranks):
            return False
        full = any(r.scheduler.num_in_flight >= self.depth for r in ranks)
        return not full and any(r.scheduler.num_unfinished for r in ranks)

    def check_worker(self) -> list[EngineCoreOutput]:
        outs = super().check_worker()
        if self.restart_pending or not self.healthy:
            outs += self._fail_the_others()
        return outs

    def _fail_the_others(self) -> list[EngineCoreOutput]:
        """A rank's worker died: the others' requests fail and their workers restart."""
        return [out for r in self.ranks for out in r.fail_all(PEER_DIED)]

    def restart_worker(self) -> list[EngineCoreOutput]:
        """Every rank's worker anew, together (a new group, at a new port)."""
        outs = self._fail_the_others()
        pending = [r for r in self.ranks if r.restart_pending]
        if not pending:
            return outs
        if len(pending) < len(self.ranks):  # NOTE: a rank that cannot restart stops them all
            return outs + self._stop_all()
        port = free_port(self.config.parallel.experts_addr)
        configs = [with_rank(self.config, i, port) for i in range(len(self.ranks))]
        with ThreadPoolExecutor(len(self.ranks), thread_name_prefix="ep-restart") as pool:
            futures = [
                pool.submit(EngineCore.restart_worker, r, c)
                for r, c in zip(self.ranks, configs, strict=True)
            ]
            outs += [out for f in futures for out in f.result()]
        if not self.healthy:  # one did not start: the others wait for it in vain
            outs += self._stop_all()
        return outs

    def _stop_all(self) -> list[EngineCoreOutput]:
        for rank in self.ranks:
            rank.healthy = False
            rank.shutdown()
        log.error("expert-parallel ranks stopped: a rank's worker could not restart")
        return []
