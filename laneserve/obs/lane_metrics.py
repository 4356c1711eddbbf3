"""Prometheus series of the lanes (laneserve's own, so under the `laneserve:` prefix):
how long each step spent on the prepare, device and output lanes, and the host gap
before each device span (the device waiting for the host). They are fed from the
engine's `LaneLog` by the dashboard's sampler, so they move while the dashboard is on
(the worker measures the spans only then); they exist, at zero, from the start.
At very high step rates the log keeps only its last steps between two reads, so the
histograms then sample the steps rather than count every one.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

from laneserve.obs.live_feed import timeline
from laneserve.obs.metrics import ENGINE
from laneserve.protocol import LaneTimes

_STEP_BUCKETS = (
    5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip
_DOCS = {
    "prepare": "seconds a step spent on the worker's prepare lane",
    "device": "seconds a step spent on the worker's device lane (forward + sample)",
    "output": "seconds a step spent on the worker's output lane (device-to-host, results)",
}


class LaneMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        self.lanes = {
            lane: Histogram(
                f"laneserve:lane_{lane}_seconds",
                doc,
                ["model_name", "engine"],
                registry=registry,
                buckets=_STEP_BUCKETS,
            )
            for lane, doc in _DOCS.items()
        }
        self.host_gap = Histogram(
            "laneserve:step_host_gap_seconds",
            "seconds the device lane waited between the previous step and this one",
            ["model_name", "engine"],
            registry=registry,
            buckets=_STEP_BUCKETS,
        )
        for metric in (*self.lanes.values(), self.host_gap):
            metric.labels(model_name=model_name, engine=ENGINE)  # exported from the start, at zero
        self._last_step = -1

    def observe(self, entries: list[tuple[int, LaneTimes]]) -> None:
        """Observe the steps of `entries` (oldest first) not observed before."""
        fresh = [(i, lt) for i, lt in entries if i > self._last_step]
        if not fresh:
            return
        self._last_step = fresh[-1][0]
        for row in timeline(fresh):
            for lane, metric in self.lanes.items():
                start, end = row[lane]
                metric.labels(model_name=self.model_name, engine=ENGINE).observe(
                    (end - start) / 1e6
                )
            if row["gap_us"] is not None:
                self.host_gap.labels(model_name=self.model_name, engine=ENGINE).observe(
                    row["gap_us"] / 1e6
                )
