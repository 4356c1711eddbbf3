"""A failed step on its way to the engine.

A worker stage that fails hands on a `StepFailure` instead of its product; the
later stages pass it along (see `Worker`), so it keeps its place in the FIFO
order of results and its releases still happen on the device stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from laneserve.protocol import RequestError, StepCommand, StepResult
from laneserve.worker.step_inputs import StepInputs


@dataclass
class StepFailure:
    step_id: int
    handles: list[int]  # the requests it scheduled: each gets the error
    message: str
    releases: list[tuple[int, int]] = field(default_factory=list)  # (slot, gen) still to release


def failed_result(failure: StepFailure) -> StepResult:
    """A failed step's result: every request it scheduled gets the error."""
    errors = [RequestError(h, failure.message) for h in failure.handles]
    return StepResult(step_id=failure.step_id, errors=errors)


def handles_of(step: StepCommand | StepInputs | StepFailure) -> list[int]:
    """The requests a step scheduled, at whatever stage it got to."""
    if isinstance(step, StepCommand):
        return [s.handle for s in step.scheduled]
    if isinstance(step, StepFailure):
        return step.handles
    return [r.handle for r in step.rows]


def salvage(item: bytes) -> tuple[int, list[int]]:
    """Best-effort step id and handles of a command that failed to decode."""
    try:
        raw = msgspec.msgpack.decode(item)
        step_id = int(raw[0])
    except Exception:
        return -1, []
    try:
        return step_id, [int(s[0]) for s in raw[1]]
    except Exception:
        return step_id, []
