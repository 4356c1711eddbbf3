"""Failed steps and failed requests on their way to the engine.

A worker stage that fails hands on a `StepFailure` instead of its product; the
later stages pass it along (see `Worker`), so it keeps its place in the FIFO
order of results and its releases still happen on the device stage.

Anything wrong about one request (a field that does not decode, a grammar that
does not compile, a handle the worker does not know) fails that request alone:
it is left out of the step, `Rejections` keeps its error under the step's id,
and the step's result carries the error in place of its output. The other
requests of the step, and the steps after it, run as if it had never been sent.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import msgspec

from laneserve.protocol import NewRequest, RequestError, StepCommand, StepResult
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


class Rejections:
    """Per step, the requests failed on their own: (handle -> message). Written by
    the command and prepare lanes, read once by the output lane."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_step: dict[int, dict[int, str]] = {}

    def add(self, step_id: int, handle: int, message: str) -> None:
        with self._lock:
            self._by_step.setdefault(step_id, {}).setdefault(handle, message)

    def of(self, step_id: int) -> dict[int, str]:
        with self._lock:
            return dict(self._by_step.get(step_id, {}))

    def take(self, step_id: int) -> dict[int, str]:
        with self._lock:
            return self._by_step.pop(step_id, {})


def with_errors(result: StepResult, errors: dict[int, str]) -> StepResult:
    """`result` where each request of `errors` has its error instead of its output."""
    if not errors:
        return result
    outputs = [o for o in result.outputs if o.handle not in errors]
    known = {e.handle for e in result.errors}
    extra = [RequestError(h, m) for h, m in errors.items() if h not in known]
    return StepResult(result.step_id, outputs, [*result.errors, *extra])


def lenient_decode(item: bytes) -> tuple[StepCommand, dict[int, str]]:
    """A command whose new requests are decoded one by one: those that do not
    decode are left out (with their error), and so are their scheduled shares.
    Raises when the command's frame itself is unreadable."""
    raw = msgspec.msgpack.decode(item)
    bad: dict[int, str] = {}
    good = []
    for entry in list(raw[2]) if len(raw) > 2 else []:
        try:
            good.append(msgspec.convert(entry, NewRequest))
        except (msgspec.ValidationError, ValueError, TypeError) as e:
            handle = int(entry[0])  # NOTE: raises (whole-step failure) if even this is bad
            bad[handle] = f"the request could not be read by the worker: {e}"
    frame = list(raw)
    if len(frame) > 2:
        frame[2] = []
    cmd = msgspec.convert(frame, StepCommand)
    scheduled = [s for s in cmd.scheduled if s.handle not in bad]
    return msgspec.structs.replace(cmd, scheduled=scheduled, new_requests=good), bad
