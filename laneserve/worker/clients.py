"""In-process worker clients.

`InlineClient` runs every step synchronously inside `submit` (the plain path,
and the reference the lanes are compared against).
"""

from __future__ import annotations

from collections import deque

from laneserve.config import EngineConfig
from laneserve.protocol import StepCommand, StepResult, WorkerReady
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

    def shutdown(self) -> None:
        self._results.clear()
