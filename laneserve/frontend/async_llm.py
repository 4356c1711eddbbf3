"""AsyncLLM: the engine loop on a background thread, one asyncio queue per request.

The HTTP event loop never runs engine work: it puts add/abort commands on a
thread-safe queue and awaits deltas that the engine thread hands over with
`call_soon_threadsafe`. A caller that goes away (client disconnect) aborts its
request, which frees its KV blocks at the next engine step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from laneserve.config import EngineConfig
from laneserve.frontend.engine import LLMEngine
from laneserve.frontend.output_processor import Delta
from laneserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[Delta | BaseException], None]


@dataclass
class _Abort:
    request_id: str


_STOP = object()


class AsyncLLM:
    def __init__(
        self, config: EngineConfig, on_step: Callable[[LLMEngine, list[Delta]], None] | None = None
    ) -> None:
        self.config = config
        self.on_step = on_step
        self.engine: LLMEngine | None = None
        self.load_error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Callable[[Delta | BaseException], None]] = {}
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

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
    def healthy(self) -> bool:
        return self.ready and self.engine.core.healthy

    def shutdown(self, timeout: float = 30.0) -> None:
        self._commands.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout)

    # -- requests --------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[Delta]:
        """Deltas for one request (n samples share the id); aborts if the caller stops."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[Delta | BaseException] = asyncio.Queue()
        sink = lambda item: loop.call_soon_threadsafe(q.put_nowait, item)  # noqa: E731
        self._commands.put(_Add(request_id, prompt_ids, params, sink))
        remaining = params.n
        try:
            while remaining:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    remaining -= 1
                yield item
        finally:
            if remaining:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    # -- the engine thread -------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = LLMEngine(self.config)
        except BaseException as e:
            self.load_error = e
            log.error("model failed to load: %s", e)
            self._ready.set()
            return
        self._ready.set()
        try:
            while self._loop_once():
                pass
        finally:
            self._fail_all(RuntimeError("the engine stopped"))
            self.engine.shutdown()

    def _loop_once(self) -> bool:
        eng = self.engine
        block = not eng.has_unfinished
        while True:
            try:
                cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
            except queue.Empty:
                break
            block = False
            if cmd is _STOP:
                return False
            self._apply(cmd)
        if eng.has_unfinished:
            deltas = eng.step()
            for d in deltas:
                sink = self._sinks.get(d.state.group_id)
                if sink is not None:
                    sink(d)
            for d in deltas:  # NOTE: after delivery: siblings may finish in the same step
                if d.finished and d.state.group_id not in eng.groups:
                    self._sinks.pop(d.state.group_id, None)
            if self.on_step is not None:
                self.on_step(eng, deltas)
        return True

    def _apply(self, cmd: _Add | _Abort) -> None:
        eng = self.engine
        if isinstance(cmd, _Abort):
            if cmd.request_id in eng.groups:
                eng.abort(cmd.request_id)
            self._sinks.pop(cmd.request_id, None)
            return
        try:
            eng.add_request(cmd.request_id, cmd.prompt_ids, cmd.params)
        except Exception as e:
            cmd.sink(e)
            return
        self._sinks[cmd.request_id] = cmd.sink

    def _fail_all(self, error: BaseException) -> None:
        for sink in self._sinks.values():
            sink(error)
        self._sinks.clear()
