"""The worker's four lanes: one thread and one FIFO queue each.

```
 submit ─► command lane ─► prepare lane ─► device lane ─► output lane ─► emit(StepResult)
           decode, register  deltas + inputs   forward+sample   reclaim (D2H, tokens)
                             into slot A|B     release (FIFO)   frees the slot
```
Two `InputSlot`s circulate: the prepare lane takes a free one (waiting if both
are in use), the output lane gives it back after reclaiming the step that
used it, so a slot is never refilled while its step can still read it.

Failures travel as `_Failure` items through the same queues: an error result
keeps its place in the FIFO order and never overtakes earlier results, and the
device lane still performs the failed step's releases.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from laneserve import protocol
from laneserve.protocol import RequestError, StepCommand, StepResult, StepTiming
from laneserve.worker.input_batch import InputSlot
from laneserve.worker.model_runner import DeviceOutputs
from laneserve.worker.worker import PendingStep, Worker

log = logging.getLogger(__name__)

_STOP = object()


@dataclass
class _Failure:
    step_id: int
    handles: list[int]
    message: str
    slot: InputSlot | None = None
    releases: list[tuple[int, int]] = field(default_factory=list)


class Lanes:
    """Builds the worker on the device lane, then runs the four lanes.

    NOTE: the worker (model loading included) is created *on the device-lane
    thread*, so the OpenMP team that runs the forward pass is that thread's
    only. A second team on the same cores (a model loaded on the main thread
    and run on a lane) made every forward pass 15-40% slower here; so did
    `torch.set_num_threads(1)` on the host lanes (it is not thread-local).
    """

    def __init__(
        self,
        make_worker: Callable[[], Worker],
        emit: Callable[[StepResult], None],
        async_prepare: bool = True,
    ) -> None:
        self.emit = emit
        self._q_cmd: queue.SimpleQueue = queue.SimpleQueue()
        self._q_prep: queue.SimpleQueue = queue.SimpleQueue()
        self._q_dev: queue.SimpleQueue = queue.SimpleQueue()
        self._q_out: queue.SimpleQueue = queue.SimpleQueue()
        self._free_slots: queue.SimpleQueue = queue.SimpleQueue()
        self._device_idle = threading.Event()
        self._device_idle.set()
        built: queue.SimpleQueue = queue.SimpleQueue()
        device = threading.Thread(
            target=self._device_main, args=(make_worker, built), name="lane-device", daemon=True
        )
        device.start()
        worker = built.get()
        if isinstance(worker, BaseException):
            device.join()
            raise worker
        self.worker: Worker = worker
        self.async_prepare = async_prepare and worker.supports_async_prepare
        for slot in worker.input_slots:
            self._free_slots.put(slot)
        self._threads = [device] + [
            threading.Thread(target=fn, name=f"lane-{name}", daemon=True)
            for name, fn in (
                ("command", self._command_lane),
                ("prepare", self._prepare_lane),
                ("output", self._output_lane),
            )
        ]
        for t in self._threads[1:]:
            t.start()

    def _device_main(self, make_worker: Callable[[], Worker], built: queue.SimpleQueue) -> None:
        try:
            worker = make_worker()
        except BaseException as e:
            built.put(e)
            return
        built.put(worker)
        self._device_lane()

    def submit(self, item: StepCommand | bytes) -> None:
        self._q_cmd.put(item)

    def close(self, timeout: float = 10.0) -> None:
        self._q_cmd.put(_STOP)
        for t in self._threads:
            t.join(timeout)

    # -- lanes -----------------------------------------------------------------
    def _command_lane(self) -> None:
        while (item := self._q_cmd.get()) is not _STOP:
            try:
                cmd = item if isinstance(item, StepCommand) else protocol.decode_command(item)
                self._q_prep.put(self.worker.command(cmd))
            except Exception as e:
                step_id, handles = _salvage(item)
                log.warning("malformed step command %s: %s", step_id, e)
                self._q_prep.put(_Failure(step_id, handles, f"malformed step command: {e}"))
        self._q_prep.put(_STOP)

    def _prepare_lane(self) -> None:
        while (item := self._q_prep.get()) is not _STOP:
            if isinstance(item, _Failure):
                self._q_dev.put(item)
                continue
            slot = self._free_slots.get()
            assert not slot.busy, f"input slot {slot.index} handed out twice"
            slot.busy = True
            if not self.async_prepare:
                self._device_idle.wait()  # NOTE: capability fallback: prepare serially
            self._q_dev.put(self._prepare(item, slot))
        self._q_dev.put(_STOP)

    def _prepare(self, pending: PendingStep, slot: InputSlot) -> object:
        try:
            self._device_idle.clear()
            return self.worker.prepare(pending, slot)
        except Exception as e:
            log.exception("prepare failed for step %d", pending.cmd.step_id)
            self._give_back(slot)
            handles = [s.handle for s in pending.cmd.scheduled]
            return _Failure(
                pending.cmd.step_id, handles, f"prepare failed: {e}", None, pending.releases
            )

    def _device_lane(self) -> None:
        while (item := self._q_dev.get()) is not _STOP:
            if isinstance(item, _Failure):
                self.worker.runner.release(item.releases)
                self._q_out.put(item)
            else:
                self._q_out.put(self._device(item))
            if self._q_dev.empty():
                self._device_idle.set()
        self._q_out.put(_STOP)

    def _device(self, inp: object) -> object:
        slot = self.worker.input_slots[inp.slot_index]
        try:
            return self.worker.device_step(inp)
        except Exception as e:
            log.exception("device step %d failed", inp.step_id)
            return _Failure(inp.step_id, [r.handle for r in inp.rows], f"step failed: {e}", slot)

    def _output_lane(self) -> None:
        while (item := self._q_out.get()) is not _STOP:
            if isinstance(item, _Failure):
                result = StepResult(
                    step_id=item.step_id,
                    errors=[RequestError(h, item.message) for h in item.handles],
                )
                if item.slot is not None:
                    self._give_back(item.slot)
            else:
                result = self._reclaim(item)
            self.emit(result)

    def _reclaim(self, out: DeviceOutputs) -> StepResult:
        inp = out.inputs
        try:
            result = self.worker.reclaim(out)
        except Exception as e:
            log.exception("reclaim failed for step %d", inp.step_id)
            result = StepResult(
                step_id=inp.step_id,
                errors=[RequestError(r.handle, f"reclaim failed: {e}") for r in inp.rows],
            )
        finally:
            self._give_back(self.worker.input_slots[inp.slot_index])
        result.timing = StepTiming(device_s=out.device_s)
        return result

    def _give_back(self, slot: InputSlot) -> None:
        slot.busy = False
        self._free_slots.put(slot)


def _salvage(item: object) -> tuple[int, list[int]]:
    """Best-effort step id and handles of a command that failed to decode."""
    if isinstance(item, StepCommand):
        return item.step_id, [s.handle for s in item.scheduled]
    try:
        raw = msgspec.msgpack.decode(item)
        step_id = int(raw[0])
    except Exception:
        return -1, []
    try:
        return step_id, [int(s[0]) for s in raw[1]]
    except Exception:
        return step_id, []
