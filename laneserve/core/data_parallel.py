"""Data parallelism: D engine cores (scheduler + KV accounting + worker) in one engine.

```
                      ┌─ rank 0: EngineCore (scheduler, KV blocks) ── worker process 0
 add_request ─ router ┤
                      └─ rank 1: EngineCore (scheduler, KV blocks) ── worker process 1
 step(): every rank fills its own pipeline (depth 2), then the results that are ready
         are taken, from whichever ranks have one (waiting for the first when none has)
```
`DataParallelCore` offers what the frontend uses of an `EngineCore`, so `LLMEngine`
holds either; with `data_parallel_size` 1 it holds the plain `EngineCore` and none of
this code runs. The ranks step independently: no rank waits for another's step.

With expert parallelism the ranks step together instead (`lockstep.py`, a subclass):
the router and the per-rank cores stay as they are.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Protocol, runtime_checkable

from laneserve.config import EngineConfig
from laneserve.core.engine_core import EngineCore, EngineDeadError, QueueFullError, WorkerClient
from laneserve.core.request import Request
from laneserve.core.router import RankView, Router, pending_tokens, prompt_hashes
from laneserve.core.scheduler import EngineCoreOutput
from laneserve.obs.lane_times import LaneLog
from laneserve.obs.profiling import Tracer
from laneserve.protocol import WorkerReady
from laneserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_WAIT_S = 0.05  # longest single wait for a result before the ranks are polled again
_POLL_S = 0.001  # per-rank poll when the ranks cannot be waited on together


@runtime_checkable
class PollableClient(Protocol):
    def result_ready(self, timeout: float) -> bool: ...


class DataParallelCore:
    """D `EngineCore`s behind one engine core's interface, a `Router` in front."""

    def __init__(
        self,
        config: EngineConfig,
        clients: Sequence[WorkerClient],
        tracer: Tracer | None = None,
        router: Router | None = None,
    ) -> None:
        handles = itertools.count(1)  # one counter: handles stay engine-unique
        self.config = config
        self.ranks = [EngineCore(config, c, tracer, handles) for c in clients]
        self.router = router or Router()
        self.depth = self.ranks[0].depth

    # -- what the frontend reads -------------------------------------------------
    @property
    def ready(self) -> WorkerReady:
        return self.ranks[0].ready

    @property
    def max_model_len(self) -> int:
        return min(r.max_model_len for r in self.ranks)

    @property
    def healthy(self) -> bool:
        """False while any rank cannot serve (a dead worker not restarted)."""
        return all(r.healthy for r in self.ranks)

    @property
    def restart_pending(self) -> bool:
        return any(r.restart_pending for r in self.ranks)

    @property
    def num_worker_restarts(self) -> int:
        return sum(r.num_worker_restarts for r in self.ranks)

    @property
    def lane_log(self) -> LaneLog:
        return self.ranks[0].lane_log  # the dashboard's lanes: rank 0's worker

    @property
    def has_unfinished(self) -> bool:
        return any(r.has_unfinished for r in self.ranks)

    # -- requests ----------------------------------------------------------------
    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        self.ranks[0].check_prompt(prompt_token_ids)

    def check_params(self, params: SamplingParams) -> None:
        self.ranks[0].check_params(params)

    def check_queue(self, num_new: int) -> None:
        """The waiting limit counts the requests waiting on every rank."""
        limit = self.config.scheduler.max_queued_requests
        waiting = sum(len(r.scheduler.waiting) for r in self.ranks)
        if limit is not None and waiting + num_new > limit:
            raise QueueFullError(f"the waiting queue is full ({limit} requests)")

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: tuple[int, ...],
    ) -> Request:
        index = self.route(prompt_token_ids, params)
        req = self.ranks[index].add_request(request_id, prompt_token_ids, params, eos_token_ids)
        req.dp_rank = index
        return req

    def route(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """The rank for a new request, among the ranks that can serve."""
        serving = [i for i, r in enumerate(self.ranks) if r.healthy]
        if not serving:
            raise EngineDeadError("every rank's worker died and was not restarted")
        cache = params.prompt_logprobs is None  # such a request computes every position
        hashes = prompt_hashes(prompt_token_ids, self.ranks[0].kv.block_size) if cache else []
        views = [self._view(i, hashes) for i in serving]
        return self.router.choose(views)

    def _view(self, index: int, hashes: list) -> RankView:
        rank = self.ranks[index]
        s = rank.scheduler
        load = sum(pending_tokens(r) for q in (s.running, s.waiting) for r in q)
        return RankView(index, load, rank.kv.cached_prefix_tokens(hashes) if hashes else 0)

    def abort(self, req: Request) -> None:
        self.ranks[req.dp_rank].abort(req)

    # -- the loop ----------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Every rank fills its pipeline; then the ready results are taken."""
        outs: list[EngineCoreOutput] = []
        for rank in self.ranks:
            if rank.has_unfinished or rank.restart_pending:
                outs += rank.fill()
        busy = [r for r in self.ranks if r.scheduler.num_in_flight]
        if busy:
            for rank in ready_ranks(busy):
                outs += rank.collect()
        return outs

    def check_worker(self) -> list[EngineCoreOutput]:
        return _each(self.ranks, EngineCore.check_worker)

    def restart_worker(self) -> list[EngineCoreOutput]:
        """Restart the ranks whose worker died (the others keep their state)."""
        return _each([r for r in self.ranks if r.restart_pending], EngineCore.restart_worker)

    def shutdown(self) -> None:
        for rank in self.ranks:
            rank.shutdown()


def _each(
    ranks: list[EngineCore], fn: Callable[[EngineCore], list[EngineCoreOutput]]
) -> list[EngineCoreOutput]:
    return [out for r in ranks for out in fn(r)]


def ready_ranks(busy: list[EngineCore]) -> list[EngineCore]:
    """The ranks whose oldest step result can be read now, waiting for the first one.

    A client that cannot be polled (an in-test fake) counts as ready: reading it blocks
    as a single engine would. A dead worker process counts as ready: its read fails.
    """
    while True:
        ready = [r for r in busy if _poll(r.client, 0.0)]
        if ready:
            return ready
        conns = [getattr(r.client, "result_connection", None) for r in busy]
        if all(isinstance(c, Connection) for c in conns):
            wait([c for c in conns if c is not None], _WAIT_S)
        else:
            for r in busy:
                if _poll(r.client, _POLL_S):
                    return [r]


def _poll(client: WorkerClient, timeout: float) -> bool:
    return not isinstance(client, PollableClient) or client.result_ready(timeout)


__all__ = ["DataParallelCore", "ready_ranks"]
