"""The engine core loop: add/abort -> schedule -> send -> (<= depth in flight) ->
update_from_output. With depth 2 (async scheduling) step N+1 is planned and
sent before step N's result is back, so the worker never waits for the engine.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

from laneserve import protocol
from laneserve.config import EngineConfig
from laneserve.core.kv_cache_manager import KVCacheManager
from laneserve.core.request import Request, RequestStatus
from laneserve.core.scheduler import EngineCoreOutput, Scheduler, SchedulerStats
from laneserve.obs.lane_times import LaneLog
from laneserve.obs.profiling import Tracer
from laneserve.protocol import StepCommand, StepResult, WorkerReady
from laneserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class WorkerDiedError(RuntimeError):
    """The worker stopped answering (its process died)."""


class WorkerClient(Protocol):
    """Transport to a worker: steps go in and come back in FIFO order."""

    ready: WorkerReady

    def submit(self, cmd: StepCommand) -> None: ...

    def get_result(self) -> StepResult: ...

    def shutdown(self) -> None: ...


@runtime_checkable
class RestartableClient(WorkerClient, Protocol):
    """A worker that can die on its own (a process) and be started again."""

    @property
    def alive(self) -> bool: ...

    def death_message(self) -> str: ...

    def restart(self, config: EngineConfig | None = None) -> None:
        """A new worker (with `config` where given: e.g. a new rendezvous port)."""
        ...


class EngineDeadError(RuntimeError):
    """The worker died and was not restarted: the engine cannot serve."""


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        client: WorkerClient,
        tracer: Tracer | None = None,
        handles: Iterator[int] | None = None,
    ) -> None:
        self.config = config
        self.client = client
        self.tracer = tracer or Tracer(None)
        self.depth = 2 if config.scheduler.async_scheduling else 1
        self.healthy = True
        self.num_worker_restarts = 0
        self.lane_log = LaneLog()  # the last steps' lane spans, when the worker sends them
        self._restart_pending = False
        # NOTE: data-parallel ranks share one counter: a handle stays engine-unique
        self._handles = handles or itertools.count(1)
        self._build(client.ready, stats=None)

    def _build(self, ready: WorkerReady, stats: SchedulerStats | None) -> None:
        """KV accounting and scheduler for a (new) worker; its cache starts empty."""
        self.ready = ready
        self.max_model_len = ready.max_model_len
        self.kv = KVCacheManager(
            [g.kind for g in ready.cache_groups],
            [g.num_blocks for g in ready.cache_groups],
            ready.block_size,
            self.config.cache.enable_prefix_caching,
            [g.block_size or ready.block_size for g in ready.cache_groups],
            [g.window for g in ready.cache_groups],
            lookahead=read_lookahead(self.config.speculative),
        )
        spec = self.config.speculative
        self.scheduler = Scheduler(
            self.config.scheduler,
            self.kv,
            ready.max_model_len,
            spec.depth if spec else 0,
            spec.disable_by_batch_size if spec else None,
        )
        if stats is not None:
            self.scheduler.stats = stats

    # -- requests ----------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: tuple[int, ...],
    ) -> Request:
        if not self.healthy:
            raise EngineDeadError("the worker died and was not restarted (--no-restart-worker)")
        self.check_prompt(prompt_token_ids)
        self.check_queue(1)
        req = Request(
            request_id=request_id,
            handle=next(self._handles),
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            eos_token_ids=eos_token_ids,
            max_model_len=self.max_model_len,
        )
        self.scheduler.add_request(req)
        return req

    def check_queue(self, num_new: int) -> None:
        """QueueFullError unless `num_new` more requests fit the waiting queue."""
        limit = self.config.scheduler.max_queued_requests
        if limit is not None and len(self.scheduler.waiting) + num_new > limit:
            raise QueueFullError(f"the waiting queue is full ({limit} requests)")

    def check_params(self, params: SamplingParams) -> None:
        """ValueError unless the params can cross to the worker (they are sent as they are)."""
        try:
            protocol.encode(params)
        except (OverflowError, UnicodeEncodeError, TypeError, ValueError) as e:
            raise ValueError(f"the sampling parameters cannot be sent to the worker: {e}") from None

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens, but max_model_len is {self.max_model_len} "
                "(prompt + at least one output token must fit)"
            )
        vocab = self.ready.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")

    def abort(self, req: Request) -> None:
        self.scheduler.abort(req.handle)

    @property
    def ranks(self) -> list[EngineCore]:
        """The data-parallel ranks' cores: this one alone (see data_parallel.py)."""
        return [self]

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self.scheduler.num_in_flight > 0

    # -- the loop ----------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Fill the pipeline up to `depth` steps, then take the oldest result.

        A dead worker fails every unfinished request; so does any unexpected error
        while building, sending or reconciling a step (the worker is then restarted:
        its state and the scheduler's can no longer be trusted to agree).
        """
        if self._restart_pending:
            failed = self.restart_worker()
            if failed:
                return failed
        try:
            self._fill()
            if self.scheduler.num_in_flight == 0:
                return []
            return self._update(self.client.get_result())
        except Exception as e:
            return self._step_failed(e)

    def _fill(self) -> None:
        """Plan and send steps until `depth` are in flight or nothing can run."""
        while self.scheduler.num_in_flight < self.depth:
            with self.tracer.span("schedule", "engine"):
                cmd = self.scheduler.schedule()
            if cmd is None:
                break
            self.client.submit(cmd)

    def _update(self, result: StepResult) -> list[EngineCoreOutput]:
        if result.lane_times is not None:
            self.lane_log.add(result.step_id, result.lane_times)
        with self.tracer.span("update", "engine", step=result.step_id):
            return self.scheduler.update_from_output(result)

    def _step_failed(self, e: Exception) -> list[EngineCoreOutput]:
        if isinstance(e, WorkerDiedError):
            return self._worker_died(f"worker failed: {e}")
        log.exception("unexpected error in an engine step")
        return self._worker_died(f"internal error in an engine step ({type(e).__name__}: {e})")

    # -- the two halves of a step, for ranks that step independently (data_parallel.py)
    def fill(self) -> list[EngineCoreOutput]:
        """A pending restart, then steps sent up to `depth`; failures, if any."""
        if self._restart_pending:
            failed = self.restart_worker()
            if failed:
                return failed
        try:
            self._fill()
        except Exception as e:
            return self._step_failed(e)
        return []

    def plan(self, force: bool = False) -> StepCommand | None:
        """One step's command, not sent (None: nothing to run; `force`: an empty step)."""
        with self.tracer.span("schedule", "engine"):
            return self.scheduler.schedule(force)

    def send(self, cmd: StepCommand) -> list[EngineCoreOutput]:
        """A planned step to the worker; failures, if any."""
        try:
            self.client.submit(cmd)
        except Exception as e:
            return self._step_failed(e)
        return []

    def fail_all(self, message: str) -> list[EngineCoreOutput]:
        """Fail every unfinished request and restart this worker (another rank's died)."""
        if self._restart_pending or not self.healthy:
            return []
        return self._worker_died(message)

    def collect(self) -> list[EngineCoreOutput]:
        """The oldest step's result (call only with a step in flight)."""
        try:
            return self._update(self.client.get_result())
        except Exception as e:
            return self._step_failed(e)

    def check_worker(self) -> list[EngineCoreOutput]:
        """Fail every unfinished request if the worker process is gone (idle or not)."""
        client = self.client
        if not isinstance(client, RestartableClient) or client.alive:
            return []
        if self._restart_pending or not self.healthy:
            return []
        return self._worker_died(f"worker failed: {client.death_message()}")

    @property
    def restart_pending(self) -> bool:
        return self._restart_pending

    def _worker_died(self, message: str) -> list[EngineCoreOutput]:
        """Every unfinished request fails now (no hang); then restart or go unhealthy."""
        log.error("%s; failing %d requests", message, self.scheduler.num_unfinished)
        self.scheduler.drop_in_flight()
        outs = []
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.fail(req.handle, message)
            outs.append(EngineCoreOutput(req, [], finished=True))
        if self.config.worker.restart_on_failure and isinstance(self.client, RestartableClient):
            self._restart_pending = True  # NOTE: after the failures reach the callers
        else:
            self.healthy = False
        return outs

    def restart_worker(self, config: EngineConfig | None = None) -> list[EngineCoreOutput]:
        """A new worker; if it cannot start, the failures of the requests that waited."""
        self._restart_pending = False
        try:
            assert isinstance(self.client, RestartableClient), "only a worker process restarts"
            self.client.restart(config) if config is not None else self.client.restart()
        except Exception as e:
            log.error("worker restart failed: %s", e)
            self.healthy = False
            outs = []
            for req in list(self.scheduler.waiting):
                self.scheduler.fail(req.handle, f"worker restart failed: {e}")
                outs.append(EngineCoreOutput(req, [], finished=True))
            return outs
        self.num_worker_restarts += 1
        arrived = list(self.scheduler.waiting)  # added after the failure, never scheduled
        self._build(self.client.ready, self.scheduler.stats)
        for req in arrived:
            self.scheduler.add_request(req)
        log.warning("worker restarted (%d restarts so far)", self.num_worker_restarts)
        return []

    def shutdown(self) -> None:
        self.client.shutdown()


class QueueFullError(RuntimeError):
    """More waiting requests than --max-queued-requests."""


__all__ = [
    "EngineCore",
    "EngineDeadError",
    "QueueFullError",
    "RequestStatus",
    "WorkerClient",
    "WorkerDiedError",
]


def read_lookahead(spec: object | None) -> int:
    """Tokens below a request's computed count that the next step may still read: the
    step in flight's tokens and a rejection of all its drafts (two steps in flight)."""
    depth = int(getattr(spec, "depth", 0) or 0)
    return 2 * (1 + depth) + 1
