"""Lane protocol tests with a fake slow model: overlap, slot ownership, FIFO
order with a malformed command and an injected exception, release ordering,
and the synchronous-prepare fallback."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import msgspec
import pytest

from laneserve import protocol
from laneserve.protocol import RequestOutput, ScheduledRequest, StepCommand, StepResult
from laneserve.worker.input_batch import InputSlot
from laneserve.worker.lanes import Lanes
from laneserve.worker.worker import PendingStep

PREPARE_S, DEVICE_S, RECLAIM_S = 0.01, 0.03, 0.01


@dataclass
class Row:
    handle: int


@dataclass
class FakeInputs:
    step_id: int
    slot_index: int
    rows: list[Row]
    releases: list


@dataclass
class FakeOutputs:
    inputs: FakeInputs
    device_s: float = 0.0


@dataclass
class FakeRunner:
    log: list = field(default_factory=list)

    def release(self, pairs: list) -> None:
        self.log.append(("release", tuple(pairs), time.perf_counter()))


class FakeTable:
    def pop_finished(self, handles: list[int]) -> list:
        return [(h, 0) for h in handles]


class FakeWorker:
    """Duck-types the Worker stages the lanes call; records spans."""

    def __init__(self, fail_device: set[int] = frozenset(), async_prepare: bool = True) -> None:
        self.input_slots = [InputSlot(i, 8, 8) for i in range(2)]
        self.supports_async_prepare = async_prepare
        self.runner = FakeRunner()
        self.table = FakeTable()
        self.fail_device = fail_device
        self.spans: list[tuple[str, int, float, float, int]] = []  # name, step, start, end, slot
        self.lock = threading.Lock()

    def _span(self, name: str, step: int, start: float, slot: int) -> None:
        with self.lock:
            self.spans.append((name, step, start, time.perf_counter(), slot))

    def command(self, cmd: StepCommand) -> PendingStep:
        return PendingStep(cmd, [])

    def prepare(self, pending: PendingStep, slot: InputSlot) -> FakeInputs:
        start = time.perf_counter()
        assert slot.busy, "the prepare lane owns the slot while preparing"
        pending.releases = self.table.pop_finished(pending.cmd.finished)
        time.sleep(PREPARE_S)
        rows = [Row(s.handle) for s in pending.cmd.scheduled]
        self._span("prepare", pending.cmd.step_id, start, slot.index)
        return FakeInputs(pending.cmd.step_id, slot.index, rows, pending.releases)

    def device_step(self, inp: FakeInputs) -> FakeOutputs:
        start = time.perf_counter()
        try:
            time.sleep(DEVICE_S)
            if inp.step_id in self.fail_device:
                raise RuntimeError("injected device failure")
            return FakeOutputs(inp)
        finally:
            self.runner.release(inp.releases)
            self._span("device", inp.step_id, start, inp.slot_index)

    def reclaim(self, out: FakeOutputs) -> StepResult:
        start = time.perf_counter()
        time.sleep(RECLAIM_S)
        slot = self.input_slots[out.inputs.slot_index]
        assert slot.busy, "a slot stays owned until its reclaim has finished"
        self._span("reclaim", out.inputs.step_id, start, slot.index)
        return StepResult(
            step_id=out.inputs.step_id,
            outputs=[RequestOutput(r.handle, [out.inputs.step_id]) for r in out.inputs.rows],
        )

    def spans_of(self, name: str) -> dict[int, tuple[float, float, int]]:
        return {step: (a, b, slot) for n, step, a, b, slot in self.spans if n == name}


def cmd(
    step: int, handles: tuple[int, ...] = (1, 2), finished: tuple[int, ...] = ()
) -> StepCommand:
    return StepCommand(
        step_id=step,
        scheduled=[ScheduledRequest(h, 1, 10, decode=True) for h in handles],
        finished=list(finished),
    )


def run_lanes(worker: FakeWorker, items: list, depth: int = 2) -> list[StepResult]:
    results: queue.SimpleQueue = queue.SimpleQueue()
    lanes = Lanes(lambda: worker, results.put)
    out = []
    try:
        submitted = 0
        while len(out) < len(items):
            while submitted < len(items) and submitted - len(out) < depth:
                lanes.submit(items[submitted])
                submitted += 1
            out.append(results.get(timeout=10))
    finally:
        lanes.close()
    return out


def test_prepare_and_reclaim_overlap_the_device() -> None:
    worker = FakeWorker()
    results = run_lanes(worker, [cmd(i) for i in range(8)])
    assert [r.step_id for r in results] == list(range(8))
    prep, dev, rec = (
        worker.spans_of("prepare"),
        worker.spans_of("device"),
        worker.spans_of("reclaim"),
    )
    for n in range(7):
        assert prep[n + 1][0] < dev[n][1], (
            f"prepare({n + 1}) did not start before device({n}) ended"
        )
        assert prep[n + 1][1] <= dev[n][1] + 0.005, (
            f"prepare({n + 1}) did not finish during device({n})"
        )
        assert rec[n][0] < dev[n + 1][1] and rec[n][1] > dev[n + 1][0], (
            f"reclaim({n}) did not overlap device({n + 1})"
        )
    # back-to-back device invocations: the gap is only the lane hand-off
    gaps = [dev[n + 1][0] - dev[n][1] for n in range(7)]
    assert max(gaps) < DEVICE_S / 2


def test_slots_are_never_reused_before_their_reclaim() -> None:
    worker = FakeWorker()
    run_lanes(worker, [cmd(i) for i in range(10)], depth=3)
    prep, rec = worker.spans_of("prepare"), worker.spans_of("reclaim")
    last_use: dict[int, int] = {}
    for step in sorted(prep):
        slot = prep[step][2]
        if slot in last_use:
            assert rec[last_use[slot]][1] <= prep[step][0] + 1e-6
        last_use[slot] = step
    assert set(last_use) == {0, 1}


def test_fifo_order_with_malformed_command_and_exception() -> None:
    worker = FakeWorker(fail_device={3})
    bad = msgspec.msgpack.encode([2, "not a list of scheduled requests"])
    items = [protocol.encode(cmd(0)), cmd(1), bad, cmd(3, (7,)), cmd(4), protocol.encode(cmd(5))]
    results = run_lanes(worker, items)
    assert [r.step_id for r in results] == [0, 1, 2, 3, 4, 5]
    assert results[2].errors == [] or all("malformed" in e.message for e in results[2].errors)
    assert not results[2].outputs
    assert [e.handle for e in results[3].errors] == [7]
    assert "injected device failure" in results[3].errors[0].message
    assert results[4].outputs and results[5].outputs and not results[4].errors


def test_unreadable_command_still_gets_a_result_in_order() -> None:
    worker = FakeWorker()
    results = run_lanes(worker, [cmd(0), b"\xc1 garbage", cmd(2)])
    assert [r.step_id for r in results] == [0, -1, 2]


def test_release_runs_in_device_order_even_when_the_step_fails() -> None:
    worker = FakeWorker(fail_device={1})
    run_lanes(worker, [cmd(0), cmd(1, finished=(5,)), cmd(2, finished=(6,))])
    released = [pairs for name, pairs, _ in worker.runner.log if pairs]
    assert released == [((5, 0),), ((6, 0),)]
    dev = worker.spans_of("device")
    rel_times = [t for _, pairs, t in worker.runner.log if pairs]
    assert dev[0][1] <= rel_times[0] and dev[1][1] <= rel_times[1] + 1e-3


def test_capability_fallback_prepares_serially() -> None:
    worker = FakeWorker(async_prepare=False)
    run_lanes(worker, [cmd(i) for i in range(5)])
    prep, dev = worker.spans_of("prepare"), worker.spans_of("device")
    for n in range(4):
        assert prep[n + 1][0] >= dev[n][1] - 1e-4, "prepare ran while the device was busy"


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
