"""Prometheus metrics for the server (one registry per server, no globals).

Gauges are refreshed from the engine after every step; counters move by the
difference since the last refresh; latency histograms are observed once per
finished request (TTFT, e2e) and per streamed token gap (inter-token latency).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.model_name = model_name

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"laneserve:{name}", doc, labels, registry=r)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"laneserve:{name}", doc, labels, registry=r)

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(f"laneserve:{name}", doc, labels, buckets=_LATENCY_BUCKETS, registry=r)

        self.running = gauge("num_requests_running", "requests in the running set")
        self.waiting = gauge("num_requests_waiting", "requests waiting to be scheduled")
        self.kv_usage = gauge("kv_cache_usage_perc", "fraction of KV blocks in use (0..1)")
        self.prefix_queries = counter(
            "prefix_cache_queries", "prompt tokens looked up in the prefix cache"
        )
        self.prefix_hits = counter("prefix_cache_hits", "prompt tokens found in the prefix cache")
        self.preemptions = counter("num_preemptions", "requests preempted (recomputed later)")
        self.prompt_tokens = counter("prompt_tokens", "prompt tokens processed")
        self.generation_tokens = counter("generation_tokens", "tokens generated")
        self.spec_drafts = counter(
            "spec_decode_num_draft_tokens", "speculative draft tokens verified"
        )
        self.spec_accepted = counter(
            "spec_decode_num_accepted_tokens", "speculative draft tokens accepted"
        )
        self.requests_ok = counter("request_success", "requests finished")
        self.worker_restarts = counter(
            "num_worker_restarts", "worker processes restarted after a failure"
        )
        self.ttft = hist("time_to_first_token_seconds", "time to the first token")
        self.itl = hist("inter_token_latency_seconds", "time between streamed tokens")
        self.e2e = hist("e2e_request_latency_seconds", "request latency")
        self._last: dict[str, int] = {}

    def label(self, metric):
        return metric.labels(model_name=self.model_name)

    def refresh(self, engine) -> None:
        s = engine.core.scheduler
        kv = engine.core.kv
        self.label(self.running).set(len(s.running))
        self.label(self.waiting).set(len(s.waiting))
        self.label(self.kv_usage).set(kv.usage)
        st = s.stats
        for metric, value in (
            (self.prefix_queries, kv.prefix_queries),
            (self.prefix_hits, kv.prefix_hits),
            (self.preemptions, st.num_preemptions),
            (self.prompt_tokens, st.num_prompt_tokens),
            (self.generation_tokens, st.num_generation_tokens),
            (self.spec_drafts, st.num_drafts),
            (self.spec_accepted, st.num_accepted),
            (self.worker_restarts, engine.core.num_worker_restarts),
        ):
            self._advance(metric, value)

    def _advance(self, metric, value: int) -> None:
        key = metric._name
        delta = value - self._last.get(key, 0)
        if delta > 0:
            self.label(metric).inc(delta)
        self._last[key] = max(value, self._last.get(key, 0)) if delta >= 0 else value

    def observe_request(self, ttft: float | None, e2e: float) -> None:
        if ttft is not None:
            self.label(self.ttft).observe(ttft)
        self.label(self.e2e).observe(e2e)
        self.label(self.requests_ok).inc()

    def observe_itl(self, gap: float) -> None:
        self.label(self.itl).observe(gap)

    def render(self) -> bytes:
        return generate_latest(self.registry)
