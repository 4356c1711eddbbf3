"""In-process worker clients (the process transport lives in `laneserve.ipc`).

`InlineClient` runs every step synchronously inside `submit`: the plain path,
and the reference the lanes are compared against. `LaneClient` runs the same
`Worker` on its four lane threads; only the transport differs from the
spawned worker process.
"""

from __future__ import annotations

import queue
from collections import deque

from laneserve.config import EngineConfig
from laneserve.protocol import StepCommand, StepResult, WorkerReady
from laneserve.worker.lanes import Lanes
from laneserve.worker.worker import Worker


class InlineClient:
    def __init__(self, config: EngineConfig, worker: Worker | None = None) -> None:
        self.worker = worker or Worker(config)
        self.ready: WorkerReady = self.worker.ready()
        self._results: deque[StepResult] = deque()

    def submit(self, cmd: StepCommand) -> None:
        self._results.append(self.worker.run_step(cmd))

    def get_result(self) -> StepResult:
        return self._results.popleft()

    def result_ready(self, timeout: float) -> bool:
        return bool(self._results)

    def shutdown(self) -> None:
        self._results.clear()
        self.worker.shutdown()


class LaneClient:
    def __init__(self, config: EngineConfig) -> None:
        self._results: queue.SimpleQueue[StepResult] = queue.SimpleQueue()
        self._taken: deque[StepResult] = deque()  # read by result_ready, not yet returned
        self.lanes = Lanes(lambda: Worker(config), self._results.put)
        self.worker = self.lanes.worker
        self.ready: WorkerReady = self.worker.ready()

    def submit(self, cmd: StepCommand) -> None:
        self.lanes.submit(cmd)

    def get_result(self) -> StepResult:
        return self._taken.popleft() if self._taken else self._results.get()

    def result_ready(self, timeout: float) -> bool:
        if not self._taken:
            try:
                self._taken.append(
                    self._results.get(timeout=timeout) if timeout else self._results.get_nowait()
                )
            except queue.Empty:
                return False
        return True

    def shutdown(self) -> None:
        self.lanes.close()
        self.worker.shutdown()
