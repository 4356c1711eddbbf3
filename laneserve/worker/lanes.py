"""The worker's four lanes: one thread and one FIFO queue each.

```
 submit ─► command lane ─► prepare lane ─► device lane ─► output lane ─► emit(StepResult)
           decode, register  deltas + inputs   forward+sample   reclaim (D2H, tokens)
                             into slot A|B     release (FIFO)   frees the slot
```
Each lane calls one `Worker` stage; the lanes own only the threads, the queues
and the two `InputSlot`s. The slots circulate: the prepare lane takes a free one
(waiting if both are in use) and it travels with its step; the output lane gives
it back after reclaiming that step, so a slot is never refilled while its step
can still read it.

A failed stage hands on a `StepFailure` instead of its product, through the same
queues, so the error result keeps its place in the FIFO order (see `failures.py`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from laneserve.protocol import StepCommand, StepResult
from laneserve.worker.failures import StepFailure
from laneserve.worker.input_batch import InputSlot
from laneserve.worker.worker import Worker

_STOP = object()


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
        self._free_slots: queue.SimpleQueue[InputSlot] = queue.SimpleQueue()
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
        for slot in worker.input_slots:  # the worker's pair, lent to the lanes for good
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
    # The queues between lanes carry (slot or None, what the last stage made).
    def _command_lane(self) -> None:
        while (item := self._q_cmd.get()) is not _STOP:
            self._q_prep.put(self.worker.command(item))
        self._q_prep.put(_STOP)

    def _prepare_lane(self) -> None:
        while (staged := self._q_prep.get()) is not _STOP:
            if isinstance(staged, StepFailure):
                self._q_dev.put((None, staged))  # no slot: nothing to prepare
                continue
            slot = self._free_slots.get()
            assert not slot.busy, f"input slot {slot.index} handed out twice"
            slot.busy = True
            if not self.async_prepare:
                self._device_idle.wait()  # NOTE: capability fallback: prepare serially
            self._device_idle.clear()
            self._q_dev.put((slot, self.worker.prepare(staged, slot)))
        self._q_dev.put(_STOP)

    def _device_lane(self) -> None:
        while (item := self._q_dev.get()) is not _STOP:
            slot, staged = item
            self._q_out.put((slot, self.worker.device_step(staged)))
            if self._q_dev.empty():
                self._device_idle.set()
        self._q_out.put(_STOP)

    def _output_lane(self) -> None:
        while (item := self._q_out.get()) is not _STOP:
            slot, staged = item
            result = self.worker.reclaim(staged)
            if slot is not None:
                slot.busy = False
                self._free_slots.put(slot)
            self.emit(result)
