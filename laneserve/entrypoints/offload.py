"""`Offload`: the server's request-side CPU work, off the event loop and bounded in time.

Compiling a request's grammar, rendering its chat template and tokenizing its
prompt can take seconds for a large request; on the event loop that would stall
every other client (and `/health`). They run here instead, on a few threads
with a large stack (the grammar engine recurses on deep grammars: a 64 MiB stack
holds far more than the limits in `structured/limits.py` let through), and a
request whose work passes its time bound is a 400 naming the bound. The thread
finishes the work in the background (it cannot be interrupted); the pool is
small, so such requests queue instead of starving the event loop.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

STACK_BYTES = 64 * 2**20
NUM_THREADS = 2
# seconds a request's preparation (grammar compile, template, tokenization) may take
PREPARE_TIMEOUT_S = 30.0

_STOP = object()


class PrepareTimeout(ValueError):
    """A request's preparation passed its time bound (a 400)."""


class Offload:
    def __init__(self, num_threads: int = NUM_THREADS, stack_bytes: int = STACK_BYTES) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        previous = threading.stack_size(stack_bytes)  # NOTE: applies to threads started now
        try:
            self._threads = [
                threading.Thread(target=self._work, name=f"offload-{i}", daemon=True)
                for i in range(num_threads)
            ]
            for t in self._threads:
                t.start()
        finally:
            threading.stack_size(previous)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not _STOP:
            fn, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # NOTE: handed to the request, the thread lives on
                future.set_exception(e)

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((fn, future))
        return future

    async def run(self, fn: Callable[[], T], what: str, timeout: float = PREPARE_TIMEOUT_S) -> T:
        """`fn()` on a pool thread; PrepareTimeout after `timeout` seconds."""
        future = self.submit(fn)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except TimeoutError:
            future.cancel()
            raise PrepareTimeout(
                f"{what} took longer than the limit of {timeout:g} s (PREPARE_TIMEOUT_S)"
            ) from None

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(_STOP)


def call(fn: Callable[..., T], *args: Any, **kw: Any) -> Callable[[], T]:
    """A zero-argument job."""
    return lambda: fn(*args, **kw)
