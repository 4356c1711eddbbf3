"""Ctrl-C in an offline program: never in the middle of an engine step.

An engine step sends work to the worker and reads its results; a KeyboardInterrupt
raised half-way through would leave the engine waiting for a result it already
dropped. So while the main thread runs a step, SIGINT is only recorded, and the
KeyboardInterrupt is raised when the step has finished. The caller then aborts its
requests and lets the steps already in flight come back (`abort_and_drain`), so the
engine is ready for the next call (a notebook cell, the next prompt).

Only the default SIGINT handler is replaced: a program with its own handler (the
chat) keeps it, and threads other than the main one never receive SIGINT anyway.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Protocol, TypeVar

T = TypeVar("T")


class StepEngine(Protocol[T]):
    @property
    def has_unfinished(self) -> bool: ...

    def step(self) -> list[T]: ...

    def abort(self, request_id: str) -> object: ...


@contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Run the block with SIGINT recorded; raise KeyboardInterrupt after it if one came."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    received: list[int] = []

    def record(signum: int, frame: FrameType | None) -> None:
        received.append(signum)

    previous = signal.signal(signal.SIGINT, record)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt


def whole_step(engine: StepEngine[T]) -> list[T]:
    """One engine step that a Ctrl-C cannot cut in half."""
    with deferred_interrupt():
        return engine.step()


def abort_and_drain(engine: StepEngine[T], request_ids: Iterable[str]) -> None:
    """Abort the requests, then run the steps already in flight to their end."""
    for rid in request_ids:
        engine.abort(rid)
    while engine.has_unfinished:
        whole_step(engine)
