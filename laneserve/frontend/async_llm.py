"""AsyncLLM: the engine loop on a background thread, one asyncio queue per request.

The HTTP event loop never runs engine work: it puts add/abort commands on a
thread-safe queue and awaits deltas that the engine thread hands over with
`call_soon_threadsafe`. `submit` returns only once the engine thread has
admitted the request (or refused it: full queue, bad input), so a server can
answer with an HTTP error before a stream starts. A caller that goes away
(client disconnect) aborts its request, which frees its KV blocks at the next
engine step.

The engine thread never dies of one bad step: an unexpected error fails the
requests in flight and restarts the worker (see `EngineCore.step`); a dead
worker process is noticed by its watcher even while the engine is idle, the
requests in flight fail with an error that says so, and the worker restarts at
once (`restarting` is true meanwhile).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from laneserve.config import EngineConfig
from laneserve.frontend.engine import LLMEngine
from laneserve.frontend.output_processor import Delta, RequestState
from laneserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)

Sink = Callable[[Delta | BaseException], None]


class EngineStoppedError(RuntimeError):
    """The engine loop is not running (stopped, or shutting down)."""


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: Sink
    admit: Callable[[BaseException | None], None]
    gone: threading.Event  # the caller left before admission: never admitted


@dataclass
class _Abort:
    request_id: str


@dataclass
class _FailAll:
    error: BaseException


_STOP = object()
_WORKER_DIED = object()  # a wake-up: the worker watcher saw the process exit


class AsyncLLM:
    def __init__(
        self, config: EngineConfig, on_step: Callable[[LLMEngine, list[Delta]], None] | None = None
    ) -> None:
        self.config = config
        self.on_step = on_step
        # called on the engine thread with the unfinished samples a caller's abort dropped
        # (a closed stream: the client left), which no delta reports
        self.on_abort: Callable[[list[RequestState]], None] | None = None
        # called on the engine thread with every sample that finished with an error
        # (a failed step, a dead worker), whether or not its caller still reads it
        self.on_failed: Callable[[list[RequestState]], None] | None = None
        self.engine: LLMEngine | None = None
        self.load_error: BaseException | None = None
        self.restarting = False
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopped = False
        self._step_since: float | None = None  # monotonic start of the step running now

    # -- life cycle ------------------------------------------------------------
    def start(self) -> None:
        """Load the model and start the engine loop, in the background."""
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.engine is not None

    @property
    def running(self) -> bool:
        """The engine thread is alive (it can die only of a bug outside a step)."""
        return self._thread is not None and self._thread.is_alive() and not self._stopped

    @property
    def healthy(self) -> bool:
        eng = self.engine
        healthy = eng is not None and eng.core.healthy
        return self.ready and self.running and not self.restarting and healthy

    @property
    def stalled_s(self) -> float:
        """Seconds the engine step running now has taken (0 when none runs): a
        worker that stopped making progress while work is pending shows here."""
        since = self._step_since
        return 0.0 if since is None else time.monotonic() - since

    @property
    def has_work(self) -> bool:
        """Requests still unfinished (read from another thread: a snapshot)."""
        eng = self.engine
        return eng is not None and eng.core.has_unfinished

    def shutdown(self, timeout: float = 30.0) -> None:
        self._commands.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout)

    def fail_all(self, error: BaseException) -> None:
        """End every request in flight with `error` (graceful shutdown's last step)."""
        self._commands.put(_FailAll(error))

    # -- requests --------------------------------------------------------------
    async def submit(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> RequestStream:
        """Admit one request (n samples share the id) and return its deltas.

        Raises what the engine raised when adding it (ValueError, QueueFullError,
        EngineDeadError) before anything is generated. Closing the returned
        iterator early aborts the request.
        """
        if not self.running:
            raise EngineStoppedError("the engine is not running")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[Delta | BaseException] = asyncio.Queue()
        admitted: asyncio.Future[None] = loop.create_future()

        def sink(item: Delta | BaseException) -> None:
            loop.call_soon_threadsafe(q.put_nowait, item)

        def admit(error: BaseException | None) -> None:
            loop.call_soon_threadsafe(_settle, admitted, error)

        gone = threading.Event()
        self._commands.put(_Add(request_id, prompt_ids, params, sink, admit, gone))
        try:
            await admitted
        except asyncio.CancelledError:
            gone.set()
            self.abort(request_id)
            raise
        return RequestStream(self, request_id, q, params.n)

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[Delta]:
        """Deltas for one request; aborts if the caller stops early."""
        stream = await self.submit(request_id, prompt_ids, params)
        try:
            async for d in stream:
                yield d
        finally:
            await stream.aclose()

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    # -- the engine thread -------------------------------------------------------
    @property
    def _eng(self) -> LLMEngine:
        """The engine, on the engine thread after it was built."""
        assert self.engine is not None, "the engine is not built yet"
        return self.engine

    def _run(self) -> None:
        try:
            self.engine = LLMEngine(self.config)
        except BaseException as e:
            self.load_error = e
            log.error("model failed to load: %s", e)
            self._ready.set()
            return
        self._watch_worker()
        self._ready.set()
        try:
            while self._loop_once():
                pass
        except BaseException:
            log.exception("the engine loop stopped")
            raise
        finally:
            self._stopped = True
            self._fail_all(EngineStoppedError("the engine stopped"))
            self._refuse_pending()
            self._eng.shutdown()

    def _watch_worker(self) -> None:
        """A dead worker process (any rank's) wakes the loop (it may be idle, blocked on
        commands)."""
        for client in self._eng.clients:
            if hasattr(client, "on_death"):
                client.on_death = lambda: self._commands.put(_WORKER_DIED)

    def _loop_once(self) -> bool:
        eng = self._eng
        block = not eng.has_unfinished
        applied = False
        while True:
            try:
                cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
            except queue.Empty:
                break
            block = False
            if cmd is _STOP:
                return False
            applied = True
            self._apply(cmd)
        if eng.core.restart_pending:  # NOTE: here, flagged: a step would restart it unflagged
            self._restart()
        if eng.has_unfinished:
            self._step()
        elif applied and self.on_step is not None:
            self.on_step(eng, [])  # NOTE: gauges move on aborts too, with no step to run
        if eng.core.restart_pending:
            self._restart()
        return True

    def _step(self) -> None:
        self._step_since = time.monotonic()
        try:
            deltas = self._eng.step()
        except Exception as e:  # NOTE: the core handles step errors; this is the last net
            log.exception("unexpected error after an engine step; failing its requests")
            for request_id in list(self._sinks):
                self._eng.abort(request_id)
            self._fail_all(RuntimeError(f"internal error: {type(e).__name__}: {e}"))
            return
        finally:
            self._step_since = None
        self._deliver(deltas)

    def _deliver(self, deltas: list[Delta]) -> None:
        eng = self._eng
        failed = [d.state for d in deltas if d.finished and d.state.error]
        if failed and self.on_failed is not None:
            self.on_failed(failed)
        for d in deltas:
            sink = self._sinks.get(d.state.group_id)
            if sink is not None:
                sink(d)
        for d in deltas:  # NOTE: after delivery: siblings may finish in the same step
            if d.finished and d.state.group_id not in eng.groups:
                self._sinks.pop(d.state.group_id, None)
        if self.on_step is not None:
            self.on_step(eng, deltas)

    def _restart(self) -> None:
        """Start a new worker now, in this thread; health says 503 meanwhile."""
        self.restarting = True
        try:
            failed = self._eng.restart_worker()
        finally:
            self.restarting = False
        self._deliver(failed)

    def _apply(self, cmd: object) -> None:
        eng = self._eng
        if cmd is _WORKER_DIED:
            self._deliver(eng.check_worker())
        elif isinstance(cmd, _Abort):
            if cmd.request_id in eng.groups:
                dropped = eng.abort(cmd.request_id)
                if dropped and self.on_abort is not None:
                    self.on_abort(dropped)
            self._sinks.pop(cmd.request_id, None)
        elif isinstance(cmd, _FailAll):
            for request_id in list(self._sinks):
                eng.abort(request_id)
            self._fail_all(cmd.error)
        elif isinstance(cmd, _Add):
            if cmd.gone.is_set():
                return  # NOTE: its caller left while it waited: nothing to admit
            try:
                eng.add_request(cmd.request_id, cmd.prompt_ids, cmd.params)
            except Exception as e:
                cmd.admit(e)
                return
            self._sinks[cmd.request_id] = cmd.sink
            cmd.admit(None)

    def _fail_all(self, error: BaseException) -> None:
        for sink in self._sinks.values():
            sink(error)
        self._sinks.clear()

    def _refuse_pending(self) -> None:
        """Adds that arrived after the loop ended must not wait forever."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                cmd.admit(EngineStoppedError("the engine stopped"))


class RequestStream:
    """The deltas of one admitted request; `aclose()` before the end aborts it.

    A class rather than an async generator: closing a generator that never
    started runs none of its code, and an admitted request must be aborted even
    if nobody ever read from it.
    """

    def __init__(self, llm: AsyncLLM, request_id: str, q: asyncio.Queue, n: int) -> None:
        self.llm, self.request_id, self.q = llm, request_id, q
        self.remaining = n  # samples not finished yet

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delta:
        if not self.remaining:
            raise StopAsyncIteration
        try:
            item = await self.q.get()
        except asyncio.CancelledError:
            await self.aclose()
            raise
        if isinstance(item, BaseException):
            self.remaining = 0  # the engine already dropped it
            raise item
        if item.finished:
            self.remaining -= 1
        return item

    async def aclose(self) -> None:
        if self.remaining:
            self.remaining = 0
            self.llm.abort(self.request_id)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # the caller went away while waiting
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
