"""Lane protocol tests: overlap, slot ownership, FIFO order with a malformed
command and injected failures, release ordering, and the synchronous-prepare
fallback.

The worker here is the real `Worker` with its stage methods (and so its failure
path) untouched; only the work they delegate (the request table, building the
inputs, the model runner) is faked. Every check is on the order of events, never
on durations: where a test needs two stages to overlap, the fake holds one stage
open until the other has happened, so lanes that did not overlap would never let
it happen (and the wait would run out).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest

from laneserve import protocol
from laneserve.obs.lane_times import LaneClock
from laneserve.obs.profiling import Tracer
from laneserve.protocol import (
    NewRequest,
    RequestOutput,
    ScheduledRequest,
    StepCommand,
    StepResult,
)
from laneserve.sampling_params import SamplingParams
from laneserve.structured.matchers import GrammarBook
from laneserve.worker.failures import Rejections
from laneserve.worker.input_batch import InputSlot
from laneserve.worker.lanes import Lanes
from laneserve.worker.worker import PendingStep, Worker

HOLD_S = 10.0  # how long a held stage waits for its partner (a correct run never waits it out)
PROBE_S = 0.2  # how long a stage gives a wrong run the chance to do what must not happen

Event = tuple  # ("prepare" | "execute" | "reclaim", "start" | "end", step) or ("release", pairs)


class EventLog:
    """Every stage's start and end, in the order they happened."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._cond = threading.Condition()

    def add(self, *event: object) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def wait_for(self, event: Event, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: event in self.events, timeout)

    def at(self, event: Event) -> int:
        return self.events.index(event)


@dataclass
class Row:
    handle: int


@dataclass
class FakeInputs:
    step_id: int
    slot_index: int
    rows: list[Row]
    releases: list
    prefills: list = field(default_factory=list)


@dataclass
class FakeOutputs:
    inputs: FakeInputs


class FakeTable:
    def pop_finished(self, handles: list[int]) -> list:
        return [(h, 0) for h in handles]

    def register(self, new: NewRequest) -> None:
        raise ValueError(f"cannot register request {new.handle}")


class FakeRunner:
    def __init__(self, worker: FakeWorker) -> None:
        self.w = worker

    def execute(self, inp: FakeInputs) -> FakeOutputs:
        w, step = self.w, inp.step_id
        w.log.add("execute", "start", step)
        try:
            if step in w.fail_execute:
                raise RuntimeError("injected device failure")
            if w.hold_execute:
                w.hold_execute(step)
            return FakeOutputs(inp)
        finally:
            w.log.add("execute", "end", step)

    def release(self, pairs: list) -> None:
        if pairs:
            self.w.log.add("release", tuple(pairs))

    def reclaim(self, out: FakeOutputs) -> StepResult:
        w, inp = self.w, out.inputs
        w.log.add("reclaim", "start", inp.step_id)
        assert w.input_slots[inp.slot_index].busy, "a slot stays owned until its reclaim ended"
        if w.hold_reclaim:
            w.hold_reclaim(inp.step_id)
        w.log.add("reclaim", "end", inp.step_id)
        outputs = [RequestOutput(r.handle, [inp.step_id]) for r in inp.rows]
        return StepResult(step_id=inp.step_id, outputs=outputs)


class FakeWorker(Worker):
    """The real Worker stages over a fake table, input builder and runner.

    `Worker.__init__` (model, KV cache) is skipped on purpose: the stage methods
    only need the attributes set here.
    """

    supports_async_prepare: bool = True

    def __init__(self, async_prepare: bool = True, fail_execute: frozenset[int] = frozenset()):
        self.tracer = Tracer(None)
        self.lane_clock = LaneClock(False)
        self.grammars = GrammarBook(Path("unused"), 8, [0])  # no structured requests here
        self.input_slots = [InputSlot(i, 8, 8) for i in range(2)]
        self.supports_async_prepare = async_prepare
        self.table = FakeTable()
        self.rejections = Rejections()
        self.runner = FakeRunner(self)
        self.fail_execute = fail_execute
        self.log = EventLog()
        self.slot_of: dict[int, int] = {}  # step -> input slot index
        self.hold_execute = None  # called with the step inside execute
        self.hold_reclaim = None  # called with the step inside reclaim

    def _build_inputs(self, pending: PendingStep, slot: InputSlot) -> FakeInputs:
        cmd = pending.cmd
        self.log.add("prepare", "start", cmd.step_id)
        assert slot.busy, "the prepare lane owns the slot while preparing"
        pending.releases = self.table.pop_finished(cmd.finished)
        if cmd.preempted:
            raise RuntimeError("injected prepare failure")
        self.slot_of[cmd.step_id] = slot.index
        rows = [Row(s.handle) for s in cmd.scheduled]
        self.log.add("prepare", "end", cmd.step_id)
        return FakeInputs(cmd.step_id, slot.index, rows, pending.releases)


def cmd(
    step: int,
    handles: tuple[int, ...] = (1, 2),
    finished: tuple[int, ...] = (),
    preempted: tuple[int, ...] = (),
) -> StepCommand:
    return StepCommand(
        step_id=step,
        scheduled=[ScheduledRequest(h, 1, 10, decode=True) for h in handles],
        finished=list(finished),
        preempted=list(preempted),
    )


def run_lanes(worker: FakeWorker, items: list, depth: int = 2) -> list[StepResult]:
    """Submit like the engine: at most `depth` steps in flight."""
    results: queue.SimpleQueue = queue.SimpleQueue()
    lanes = Lanes(lambda: worker, results.put)
    out = []
    try:
        submitted = 0
        while len(out) < len(items):
            while submitted < len(items) and submitted - len(out) < depth:
                lanes.submit(items[submitted])
                submitted += 1
            out.append(results.get(timeout=60))
    finally:
        lanes.close()
    return out


def test_prepare_and_reclaim_overlap_the_device() -> None:
    n = 8
    worker = FakeWorker()
    missed: list[str] = []

    def hold(what: str, until: Event) -> None:
        if not missed and not worker.log.wait_for(until, HOLD_S):
            missed.append(f"{what} waited in vain for {until}")

    def hold_execute(step: int) -> None:
        # device(n) runs until prepare(n+1) has finished and reclaim(n-1) has started
        if step + 1 < n:
            hold(f"execute {step}", ("prepare", "end", step + 1))
        if step > 0:
            hold(f"execute {step}", ("reclaim", "start", step - 1))

    def hold_reclaim(step: int) -> None:  # reclaim(n) runs until device(n+1) has started
        if step + 1 < n:
            hold(f"reclaim {step}", ("execute", "start", step + 1))

    worker.hold_execute, worker.hold_reclaim = hold_execute, hold_reclaim
    results = run_lanes(worker, [cmd(i) for i in range(n)])
    assert [r.step_id for r in results] == list(range(n))
    assert not missed, missed
    at = worker.log.at
    for s in range(n - 1):
        # the next step's inputs are ready before the device finishes this one
        assert at(("prepare", "end", s + 1)) < at(("execute", "end", s))
        assert at(("reclaim", "start", s)) < at(("execute", "end", s + 1))
        assert at(("execute", "start", s + 1)) < at(("reclaim", "end", s))


def test_slots_are_never_reused_before_their_reclaim() -> None:
    n = 10
    worker = FakeWorker()

    def hold_reclaim(step: int) -> None:
        # give a wrong run the chance to refill this step's slot under it
        worker.log.wait_for(("prepare", "start", step + 2), PROBE_S)

    worker.hold_reclaim = hold_reclaim
    run_lanes(worker, [cmd(i) for i in range(n)], depth=3)
    at = worker.log.at
    last_use: dict[int, int] = {}
    for step in range(n):
        slot = worker.slot_of[step]
        if slot in last_use:
            assert at(("reclaim", "end", last_use[slot])) < at(("prepare", "start", step))
        last_use[slot] = step
    assert set(last_use) == {0, 1}


def test_fifo_order_with_malformed_command_and_exception() -> None:
    worker = FakeWorker(fail_execute=frozenset({3}))
    # step 2's scheduled requests decode, its new_requests do not
    bad = msgspec.msgpack.encode([2, [[8, 1, 10, True], [9, 1, 10, True]], "not a list"])
    new = NewRequest(11, "r11", [1, 2], SamplingParams())
    items = [
        protocol.encode(cmd(0)),
        cmd(1),
        bad,
        cmd(3, (7,)),
        cmd(4),
        protocol.encode(cmd(5)),
        StepCommand(6, [ScheduledRequest(11, 2, 0)], [new]),  # register fails
        cmd(7, (12,), preempted=(3,)),  # prepare fails
        cmd(8),
    ]
    results = run_lanes(worker, items)
    assert [r.step_id for r in results] == list(range(9))
    assert not results[2].outputs and [e.handle for e in results[2].errors] == [8, 9]
    assert all("malformed step command" in e.message for e in results[2].errors)
    assert [e.handle for e in results[3].errors] == [7] and not results[3].outputs
    assert "step failed: injected device failure" in results[3].errors[0].message
    assert [e.handle for e in results[6].errors] == [11]
    # NOTE: a request that fails to register fails alone (its step runs on)
    assert "request rejected: cannot register request 11" in results[6].errors[0].message
    assert [e.handle for e in results[7].errors] == [12]
    assert "prepare failed: injected prepare failure" in results[7].errors[0].message
    for ok in (0, 1, 4, 5, 8):
        assert results[ok].outputs and not results[ok].errors, ok


def test_unreadable_command_still_gets_a_result_in_order() -> None:
    worker = FakeWorker()
    results = run_lanes(worker, [cmd(0), b"\xc1 garbage", cmd(2)])
    assert [r.step_id for r in results] == [0, -1, 2]
    assert results[1].errors == [] and results[1].outputs == []


def test_release_runs_in_device_order_even_when_the_step_fails() -> None:
    worker = FakeWorker(fail_execute=frozenset({1}))
    items = [
        cmd(0),
        cmd(1, finished=(5,)),  # its device step fails
        cmd(2, finished=(6,), preempted=(3,)),  # its prepare fails
        cmd(3, finished=(7,)),
    ]
    results = run_lanes(worker, items)
    assert [bool(r.errors) for r in results] == [False, True, True, False]
    at, events = worker.log.at, worker.log.events
    released = [e[1] for e in events if e[0] == "release"]
    assert released == [((5, 0),), ((6, 0),), ((7, 0),)]
    # each after the device ran every earlier step (and the step itself, when it ran)
    assert at(("execute", "end", 1)) < at(("release", ((5, 0),)))
    assert at(("execute", "end", 1)) < at(("release", ((6, 0),))) < at(("execute", "start", 3))
    assert at(("execute", "end", 3)) < at(("release", ((7, 0),)))


def test_capability_fallback_prepares_serially() -> None:
    n = 5
    worker = FakeWorker(async_prepare=False)

    def hold_execute(step: int) -> None:
        # give a wrong run the chance to prepare the next step meanwhile
        worker.log.wait_for(("prepare", "start", step + 1), PROBE_S)

    worker.hold_execute = hold_execute
    run_lanes(worker, [cmd(i) for i in range(n)])
    at = worker.log.at
    for s in range(n - 1):
        assert at(("execute", "end", s)) < at(("prepare", "start", s + 1)), (
            f"prepare({s + 1}) ran while the device was busy"
        )


@pytest.mark.parametrize("num_requests", [32])
def test_steady_decode_command_is_small(num_requests: int) -> None:
    c = StepCommand(
        step_id=123456,
        scheduled=[
            ScheduledRequest(1000 + i, 1, 700 + i, decode=True) for i in range(num_requests)
        ],
    )
    assert len(protocol.encode(c)) < 4096
    assert protocol.decode_command(protocol.encode(c)) == c
