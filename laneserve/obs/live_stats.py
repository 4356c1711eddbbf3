"""The dashboard's numbers, read from the server's own Prometheus registry.

A `Snapshot` is one reading of every series (summed over label sets, except the
`finished_reason` / `position` / `le` labels that the dashboard splits by). A point
(`derive`) compares the newest snapshot with older ones: rates over a short window,
and over a longer sliding window the latency percentiles, the prefix-cache hit rate
and the speculative acceptance. Percentiles come from the histograms' bucket counts
with linear interpolation inside a bucket, as PromQL's `histogram_quantile` computes
them, so the page and a Grafana panel over the same window show the same values.
Nothing here touches the engine: the registry is already kept current by the server.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

QUANTILES = (0.5, 0.9, 0.99)
LATENCIES = {
    "ttft": "vllm:time_to_first_token_seconds",
    "tpot": "vllm:request_time_per_output_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
}
REASONS = ("stop", "length", "abort", "error")
_SPLIT_LABELS = ("finished_reason", "position")


@dataclass
class Snapshot:
    t: float  # wall clock (time.time())
    values: dict[str, float] = field(default_factory=dict)  # counters and gauges
    buckets: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # cumulative

    def get(self, name: str) -> float:
        return self.values.get(name, 0.0)


def read_registry(registry: CollectorRegistry, t: float) -> Snapshot:
    snap = Snapshot(t)
    for family in registry.collect():
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            if s.name.endswith("_bucket") and "le" in s.labels:
                le = float(s.labels["le"])
                pairs = snap.buckets.setdefault(s.name.removesuffix("_bucket"), [])
                _add_bucket(pairs, le, s.value)
                continue
            key = s.name + "".join(f"{{{s.labels[k]}}}" for k in _SPLIT_LABELS if k in s.labels)
            snap.values[key] = snap.values.get(key, 0.0) + s.value
    for pairs in snap.buckets.values():
        pairs.sort()
    return snap


def _add_bucket(pairs: list[tuple[float, float]], le: float, value: float) -> None:
    for i, (bound, count) in enumerate(pairs):
        if bound == le:
            pairs[i] = (bound, count + value)
            return
    pairs.append((le, value))


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """`histogram_quantile(q, ...)` over cumulative (le, count) pairs; None when empty."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower  # NOTE: as PromQL, the top finite bound
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def bucket_delta(
    new: list[tuple[float, float]], old: list[tuple[float, float]] | None
) -> list[tuple[float, float]]:
    if not old or len(old) != len(new):
        return new
    return [(le, max(0.0, c - o)) for (le, c), (_, o) in zip(new, old, strict=True)]


def _rate(new: Snapshot, old: Snapshot, name: str) -> float | None:
    dt = new.t - old.t
    if dt <= 0:
        return None
    return max(0.0, new.get(name) - old.get(name)) / dt


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def spec_positions(snap: Snapshot) -> int:
    prefix = "vllm:spec_decode_num_accepted_tokens_per_pos_total{"
    return sum(1 for k in snap.values if k.startswith(prefix))


def derive(new: Snapshot, rate_base: Snapshot, window_base: Snapshot) -> dict:
    """One dashboard point at `new.t`: rates since `rate_base`, window stats since
    `window_base` (both older snapshots of the same registry)."""
    point: dict = {"t": round(new.t, 3)}
    point["prompt_tps"] = _rate(new, rate_base, "vllm:prompt_tokens_total")
    point["gen_tps"] = _rate(new, rate_base, "vllm:generation_tokens_total")
    for reason in REASONS:
        point[f"fin_{reason}"] = _rate(new, rate_base, f"vllm:request_success_total{{{reason}}}")
    point["running"] = new.get("vllm:num_requests_running")
    point["waiting"] = new.get("vllm:num_requests_waiting")
    point["kv_usage"] = new.get("vllm:kv_cache_usage_perc")
    w = window_base

    def delta(name: str) -> float:
        return max(0.0, new.get(name) - w.get(name))

    point["prefix_hit_rate"] = _ratio(
        delta("vllm:prefix_cache_hits_total"), delta("vllm:prefix_cache_queries_total")
    )
    for key, name in LATENCIES.items():
        window = bucket_delta(new.buckets.get(name, []), w.buckets.get(name))
        point[key] = [quantile(q, window) for q in QUANTILES]
    drafts = delta("vllm:spec_decode_num_drafts_total")
    point["spec_accept"] = [
        _ratio(delta(f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{{pos}}}"), drafts)
        for pos in range(spec_positions(new))
    ]
    accepted = _ratio(delta("vllm:spec_decode_num_accepted_tokens_total"), drafts)
    point["spec_mean_len"] = None if accepted is None else 1.0 + accepted
    point["restarts"] = new.get("laneserve:num_worker_restarts_total")
    return point


def totals(snap: Snapshot) -> dict:
    """Counts since the server started, for the page's summary line."""
    return {
        "finished": {r: snap.get(f"vllm:request_success_total{{{r}}}") for r in REASONS},
        "prompt_tokens": snap.get("vllm:prompt_tokens_total"),
        "generation_tokens": snap.get("vllm:generation_tokens_total"),
        "preemptions": snap.get("vllm:num_preemptions_total"),
        "worker_restarts": snap.get("laneserve:num_worker_restarts_total"),
    }
