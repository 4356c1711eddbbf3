"""Per-step lane spans for the live dashboard, measured once and shared with the trace.

Worker side, `LaneClock`: each lane stage (prepare, device, output) marks its start and
end for the step it ran; `take()` hands the three spans on with the step's `StepResult`.
Disabled (the default), a stage pays one attribute test; `span()` then returns the
tracer's own span, so a `--profile-dir` run without the dashboard is unchanged. Enabled,
one pair of `perf_counter_ns()` readings feeds both the trace event and the spans
sent to the engine, so the dashboard's timeline and the trace agree to the nanosecond.

Engine side, `LaneLog`: a fixed ring of the last steps' spans. The engine thread writes
one slot per step; readers on other threads copy the list (atomic in CPython) and sort
by step id, so neither side takes a lock.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from laneserve.obs.profiling import Tracer
from laneserve.protocol import LaneTimes

LANES = ("prepare", "device", "output")
_INDEX = {name: i for i, name in enumerate(LANES)}


class LaneClock:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._open: dict[int, list[int]] = {}  # step id -> [start, end] x LANES

    def mark(self, step_id: int, lane: str, start_ns: int, end_ns: int) -> None:
        if not self.enabled:
            return
        i = 2 * _INDEX[lane]
        self._open.setdefault(step_id, [0] * 6)[i : i + 2] = (start_ns, end_ns)

    def take(self, step_id: int) -> LaneTimes | None:
        """The step's spans, once; None if a lane did not run it (a failed step)."""
        marks = self._open.pop(step_id, None)
        if marks is None or 0 in marks:
            return None
        return LaneTimes(
            prepare=(marks[0], marks[1]), device=(marks[2], marks[3]), output=(marks[4], marks[5])
        )

    def span(
        self, tracer: Tracer, name: str, lane: str, step_id: int
    ) -> contextlib.AbstractContextManager:
        """A trace span named `name` (the trace's own lane) that also marks `lane`."""
        if not self.enabled:
            return tracer.span(name, step=step_id)
        return self._both(tracer, name, lane, step_id)

    @contextlib.contextmanager
    def _both(self, tracer: Tracer, name: str, lane: str, step_id: int) -> Iterator[None]:
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            end = time.perf_counter_ns()
            tracer.add(name, name, start, end, {"step": step_id})
            self.mark(step_id, lane, start, end)


class LaneLog:
    """The last `size` steps' lane spans (engine side)."""

    def __init__(self, size: int = 2048) -> None:
        self.size = size
        self._ring: list[tuple[int, LaneTimes] | None] = [None] * size
        self._count = 0

    def add(self, step_id: int, times: LaneTimes) -> None:
        self._ring[self._count % self.size] = (step_id, times)
        self._count += 1

    def recent(self, n: int) -> list[tuple[int, LaneTimes]]:
        """Up to the last `n` steps, oldest first."""
        entries = [e for e in list(self._ring) if e is not None]
        entries.sort(key=lambda e: e[0])
        return entries[-n:] if n > 0 else []
