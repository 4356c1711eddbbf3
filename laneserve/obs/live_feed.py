"""What the dashboard page reads: recent points, the lanes timeline, history samples.

`LiveFeed.tick()` runs once a second (the server's sampler task): it reads the
registry, derives a point (see `live_stats`), keeps the last `live_s` seconds of
points in memory for the live view, and every `sample_s` seconds returns the point
for the history file. The lanes come from the engine's `LaneLog`: the spans of the
last steps as the worker measured them, in microseconds of its monotonic clock (the
unit and clock of a `--profile-dir` trace), and the host gap before each device span.
"""

from __future__ import annotations

import statistics
from collections import deque

from prometheus_client import CollectorRegistry

from laneserve.obs.lane_times import LANES
from laneserve.obs.live_stats import Snapshot, derive, read_registry
from laneserve.protocol import LaneTimes

RATE_WINDOW_S = 5.0  # tokens/s and requests/s: over the last 5 s
STATS_WINDOW_S = 60.0  # percentiles, hit rate, acceptance: over the last minute


class LiveFeed:
    def __init__(
        self, registry: CollectorRegistry, sample_s: float = 5.0, live_s: float = 900.0
    ) -> None:
        self.registry = registry
        self.sample_s = sample_s
        self._snaps: deque[Snapshot] = deque()
        self.points: deque[dict] = deque(maxlen=max(2, int(live_s)))
        self._last_sample_t = 0.0
        self._last_step = -1  # newest step already summarized in a point

    def tick(self, now: float, lanes: list[tuple[int, LaneTimes]] | None = None) -> dict | None:
        """Read and keep a point; return it when a history sample is due."""
        snap = read_registry(self.registry, now)
        self._snaps.append(snap)
        while len(self._snaps) > 2 and now - self._snaps[1].t >= STATS_WINDOW_S:
            self._snaps.popleft()
        point = derive(snap, self._base(now - RATE_WINDOW_S), self._snaps[0])
        point.update(self._lane_stats(lanes or []))
        self.points.append(point)
        if now - self._last_sample_t >= self.sample_s:
            self._last_sample_t = now
            return point
        return None

    def _base(self, t: float) -> Snapshot:
        """The newest snapshot at or before `t` (the oldest if none is that old)."""
        base = self._snaps[0]
        for s in self._snaps:
            if s.t > t:
                break
            base = s
        return base

    def _lane_stats(self, lanes: list[tuple[int, LaneTimes]]) -> dict:
        """Median host gap and device busy share over the steps since the last point."""
        fresh = [(i, lt) for i, lt in lanes if i > self._last_step]
        if lanes:
            self._last_step = max(self._last_step, lanes[-1][0])
        steps = timeline(fresh)
        gaps = [s["gap_us"] for s in steps if s["gap_us"] is not None]
        busy = None
        if steps:
            span = steps[-1]["device"][1] - steps[0]["device"][0]
            work = sum(s["device"][1] - s["device"][0] for s in steps)
            busy = min(1.0, work / span) if span > 0 else None
        return {
            "steps": len(steps),
            "host_gap_ms": statistics.median(gaps) / 1000.0 if gaps else None,
            "device_busy": busy,
        }

    def recent(self, since: float) -> list[dict]:
        return [p for p in list(self.points) if p["t"] > since]


def timeline(entries: list[tuple[int, LaneTimes]]) -> list[dict]:
    """Per step, oldest first: its spans in µs and the gap since the device span of
    the step before it (None for the first, or after a step missing from the log)."""
    out: list[dict] = []
    prev: tuple[int, LaneTimes] | None = None
    for step_id, lt in entries:
        row: dict = {"step": step_id}
        for lane in LANES:
            start, end = getattr(lt, lane)
            row[lane] = [start / 1000.0, end / 1000.0]
        gap = None
        if prev is not None and prev[0] == step_id - 1:
            gap = max(0, lt.device[0] - prev[1].device[1]) / 1000.0
        row["gap_us"] = gap
        out.append(row)
        prev = (step_id, lt)
    return out
