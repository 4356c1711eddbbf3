"""Per-step spans as Chrome trace events (open the JSON in Perfetto / chrome://tracing).

`Tracer(None)` is a no-op: `span()` returns a shared null context and costs a
function call. With a directory, spans are kept in memory and written by
`flush()` to `<dir>/trace-<role>-<pid>.json` (`trace-<role>-r<rank>-<pid>.json` for a
data-parallel rank's worker). Span names follow the lanes:
schedule, encode, ipc, command, prepare, device, reclaim, release, detokenize.
Timestamps come from the monotonic clock, so traces of the engine and worker
processes line up. Each role numbers its lanes from its own base (engine 100+,
worker 200+), so an engine and an in-process worker that share a pid never
share a thread id (a data-parallel rank r adds 1000 r, for ranks that share a process):
`laneserve profile merge` joins the files into one timeline.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

# Thread ids of each role's lanes start here; roles not listed use OTHER_TID_BASE.
ROLE_TID_BASE = {"engine": 100, "worker": 200}
OTHER_TID_BASE = 900
RANK_TID_STRIDE = 1000
TP_ROLE = "worker-tp"  # a tensor-parallel rank's worker (each rank its own process)


class Tracer:
    def __init__(
        self, directory: str | Path | None, role: str = "engine", rank: int | None = None
    ) -> None:
        self.enabled = directory is not None
        self.directory = Path(directory) if directory is not None else None
        self.role = role
        self.rank = rank  # a data-parallel rank's worker: named and numbered apart
        self._events: list[dict] = []
        self._lock = threading.Lock()
        self._tids: dict[str, int] = {}
        self._tid_base = ROLE_TID_BASE.get(role, OTHER_TID_BASE) + RANK_TID_STRIDE * (rank or 0)

    @property
    def process_name(self) -> str:
        return self.role if self.rank is None else f"{self.role} rank {self.rank}"

    @contextlib.contextmanager
    def _record(self, name: str, lane: str, args: dict) -> Iterator[None]:
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            self.add(name, lane, start, time.perf_counter_ns(), args)

    def span(
        self, name: str, lane: str | None = None, **args: object
    ) -> contextlib.AbstractContextManager:
        if not self.enabled:
            return contextlib.nullcontext()
        return self._record(name, lane or name, args)

    def add(
        self, name: str, lane: str, start_ns: int, end_ns: int, args: dict | None = None
    ) -> None:
        if not self.enabled:
            return
        with self._lock:
            tid = self._tids.setdefault(lane, self._tid_base + len(self._tids))
            self._events.append(
                {
                    "name": name,
                    "ph": "X",
                    "ts": start_ns / 1000.0,
                    "dur": (end_ns - start_ns) / 1000.0,
                    "pid": os.getpid(),
                    "tid": tid,
                    "args": args or {},
                }
            )

    def flush(self) -> Path | None:
        if not self.enabled or self.directory is None:
            return None
        self.directory.mkdir(parents=True, exist_ok=True)
        rank = "" if self.rank is None else f"-r{self.rank}"
        path = self.directory / f"trace-{self.role}{rank}-{os.getpid()}.json"
        with self._lock:
            meta = [
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": os.getpid(),
                    "tid": tid,
                    "args": {"name": f"{self.process_name}/{lane}"},
                }
                for lane, tid in self._tids.items()
            ]
            meta.append(
                {
                    "name": "process_name",
                    "ph": "M",
                    "pid": os.getpid(),
                    "args": {"name": self.process_name},
                }
            )
            data = {"traceEvents": meta + self._events, "displayTimeUnit": "ms"}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
        return path


NULL_TRACER = Tracer(None)
