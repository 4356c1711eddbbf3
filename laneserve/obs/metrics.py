"""Prometheus metrics for the server with vLLM's names and labels (one registry per
server, no globals), so that dashboards built for vLLM work unchanged; the table
is docs/metrics.md.

Every series carries vLLM's `model_name` and `engine` labels (`engine` is the
data-parallel rank: "0" .. "D-1", as vLLM labels its engine cores) and exists from the
start with zero values: the children (and the `finished_reason` / `position` / `source`
ones) are created here, not on first use, for every rank.
Gauges are refreshed from the engine after every step; counters move by the
difference since the last refresh; request histograms are observed once per
finished request, token-gap histograms per streamed token gap.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480)
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))  # 1 .. 5e6
FINISHED_REASONS = ("stop", "length", "abort", "error")
PROMPT_SOURCES = ("local_compute", "local_cache_hit")
ENGINE = "0"  # vLLM's `engine` label of the first engine core (data-parallel rank 0)


class ServerMetrics:
    def __init__(self, model_name: str, num_engines: int = 1) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        # one label set per engine core (data-parallel rank); `labels`: rank 0's
        self.engines = [{"model_name": model_name, "engine": str(i)} for i in range(num_engines)]
        self.labels = self.engines[0]
        self._last: dict[int, dict[str, int]] = {}  # per engine core: values last seen
        self._groups: dict[str, list[int]] = {}  # request -> [samples left, most tokens]
        self._described = False
        self._gauges()
        self._counters()
        self._histograms()

    # -- definitions -----------------------------------------------------------
    def _gauges(self) -> None:
        self.running = self._make(Gauge, "num_requests_running", "requests in the running set")
        self.waiting = self._make(Gauge, "num_requests_waiting", "requests waiting to be scheduled")
        self.kv_usage = self._make(Gauge, "kv_cache_usage_perc", "fraction of KV blocks in use")
        # vLLM's older names, still read by its earlier dashboards: the same KV usage;
        # no CPU swap tier and no swapped requests here (preemption recomputes), so 0
        self.gpu_usage = self._make(Gauge, "gpu_cache_usage_perc", "fraction of KV blocks in use")
        self._make(Gauge, "cpu_cache_usage_perc", "CPU swap-space KV usage (none: always 0)")
        self._make(Gauge, "num_requests_swapped", "requests swapped to CPU (none: always 0)")
        self.cache_info = Gauge(
            "vllm:cache_config_info",
            "the KV cache's configuration (labels; value 1)",
            ["model_name", "engine", "block_size", "num_gpu_blocks", "enable_prefix_caching"],
            registry=self.registry,
        )

    def _counters(self) -> None:
        c = self._make
        self.prefix_queries = c(Counter, "prefix_cache_queries", "prompt tokens looked up")
        self.prefix_hits = c(Counter, "prefix_cache_hits", "prompt tokens found in the cache")
        self.preemptions = c(Counter, "num_preemptions", "requests preempted")
        self.prompt_tokens = c(Counter, "prompt_tokens", "prompt tokens (cached included)")
        self.prompt_cached = c(Counter, "prompt_tokens_cached", "prompt tokens from the cache")
        self.prompt_by_source = Counter(
            "vllm:prompt_tokens_by_source",
            "prompt tokens, by where their KV came from",
            ["model_name", "engine", "source"],
            registry=self.registry,
        )
        for source in PROMPT_SOURCES:
            for labels in self.engines:
                self.prompt_by_source.labels(**labels, source=source)
        self.generation_tokens = c(Counter, "generation_tokens", "tokens generated")
        self.spec_num_drafts = c(Counter, "spec_decode_num_drafts", "steps that verified drafts")
        self.spec_drafts = c(Counter, "spec_decode_num_draft_tokens", "draft tokens verified")
        self.spec_accepted = c(Counter, "spec_decode_num_accepted_tokens", "draft tokens accepted")
        self.spec_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "draft tokens accepted, by draft position",
            ["model_name", "engine", "position"],
            registry=self.registry,
        )
        self.requests_ok = Counter(
            "vllm:request_success",
            "requests finished, by reason",
            ["model_name", "engine", "finished_reason"],
            registry=self.registry,
        )
        for reason in FINISHED_REASONS:
            for labels in self.engines:
                self.requests_ok.labels(**labels, finished_reason=reason)
        # NOTE: laneserve's own (vLLM has no worker restarts): its own prefix
        self.worker_restarts = Counter(
            "laneserve:num_worker_restarts",
            "worker processes restarted after a failure",
            ["model_name", "engine"],
            registry=self.registry,
        )
        for labels in self.engines:
            self.worker_restarts.labels(**labels)

    def _histograms(self) -> None:
        h, lat, req, tok = self._make, _LATENCY_BUCKETS, _REQUEST_BUCKETS, _TOKEN_BUCKETS
        self.ttft = h(Histogram, "time_to_first_token_seconds", "time to the first token", lat)
        self.itl = h(Histogram, "inter_token_latency_seconds", "gap between tokens", lat)
        self.tpot = h(Histogram, "time_per_output_token_seconds", "gap between tokens", lat)
        self.req_tpot = h(
            Histogram, "request_time_per_output_token_seconds", "decode time per token", lat
        )
        self.e2e = h(Histogram, "e2e_request_latency_seconds", "arrival to finish", req)
        self.queue = h(Histogram, "request_queue_time_seconds", "arrival to first scheduled", req)
        self.prefill = h(Histogram, "request_prefill_time_seconds", "scheduled to first token", req)
        self.decode = h(Histogram, "request_decode_time_seconds", "first token to finish", req)
        self.inference = h(Histogram, "request_inference_time_seconds", "scheduled to finish", req)
        self.req_prompt = h(Histogram, "request_prompt_tokens", "prompt tokens per request", tok)
        self.req_gen = h(Histogram, "request_generation_tokens", "tokens per request", tok)
        self.req_max_gen = h(
            Histogram,
            "request_max_num_generation_tokens",
            "most tokens generated by one of a request's n samples",
            tok,
        )
        self.iteration = h(Histogram, "iteration_tokens_total", "tokens per engine step", tok)

    def _make(self, kind, name: str, doc: str, buckets: tuple | None = None):
        kw = {"buckets": buckets} if buckets is not None else {}
        names = ["model_name", "engine"]
        metric = kind(f"vllm:{name}", doc, names, registry=self.registry, **kw)
        for labels in self.engines:
            metric.labels(**labels)  # exported from the start, at zero
        return metric

    def label(self, metric, engine: int = 0):
        return metric.labels(**self.engines[engine])

    # -- updates -------------------------------------------------------------------
    def describe(self, engine) -> None:
        """vllm:cache_config_info, once the engine (and so its KV caches) exists."""
        if self._described:
            return
        for labels, core in zip(self.engines, engine.core.ranks, strict=True):
            ready = core.ready
            self.cache_info.labels(
                **labels,
                block_size=str(ready.block_size),
                num_gpu_blocks=str(sum(g.num_blocks for g in ready.cache_groups)),
                enable_prefix_caching=str(engine.config.cache.enable_prefix_caching),
            ).set(1)
        self._described = True

    def refresh(self, engine) -> None:
        self.describe(engine)
        for i, core in enumerate(engine.core.ranks):
            self._refresh_rank(i, core)

    def _refresh_rank(self, i: int, core) -> None:
        """One engine core's gauges, and its counters by their difference."""
        s, kv, labels = core.scheduler, core.kv, self.engines[i]
        last = self._last.setdefault(i, {})
        self.label(self.running, i).set(len(s.running))
        self.label(self.waiting, i).set(len(s.waiting))
        self.label(self.kv_usage, i).set(kv.usage)
        self.label(self.gpu_usage, i).set(kv.usage)
        st = s.stats
        steps = st.num_steps - last.get("steps", 0)
        tokens = st.num_scheduled_tokens - last.get("scheduled", 0)
        if steps > 0:  # NOTE: refreshes may see more than one step: their mean
            for _ in range(steps):
                self.label(self.iteration, i).observe(tokens / steps)
        last["steps"], last["scheduled"] = st.num_steps, st.num_scheduled_tokens
        for metric, value in (
            (self.prefix_queries, kv.prefix_queries),
            (self.prefix_hits, kv.prefix_hits),
            (self.preemptions, st.num_preemptions),
            (self.prompt_tokens, st.num_request_prompt_tokens),
            (self.prompt_cached, st.num_cached_prompt_tokens),
            (self.generation_tokens, st.num_generation_tokens),
            (self.spec_num_drafts, st.drafts_per_position[0] if st.drafts_per_position else 0),
            (self.spec_drafts, st.num_drafts),
            (self.spec_accepted, st.num_accepted),
            (self.worker_restarts, core.num_worker_restarts),
        ):
            _advance(last, self.label(metric, i), metric._name, value)
        for pos, value in enumerate(st.accepted_per_position):
            child = self.spec_per_pos.labels(**labels, position=str(pos))
            _advance(last, child, f"pos{pos}", value)
        computed = st.num_request_prompt_tokens - st.num_cached_prompt_tokens
        for source, value in zip(
            PROMPT_SOURCES, (computed, st.num_cached_prompt_tokens), strict=True
        ):
            child = self.prompt_by_source.labels(**labels, source=source)
            _advance(last, child, source, value)

    def observe_request(self, times: RequestTimes) -> None:
        """One finished request (on the engine core that served it)."""
        e = times.engine

        def lab(metric):
            return self.label(metric, e)

        if times.first_token is not None:
            lab(self.ttft).observe(times.first_token - times.arrival)
        lab(self.e2e).observe(times.finished - times.arrival)
        lab(self.req_prompt).observe(times.num_prompt)
        lab(self.req_gen).observe(times.num_output)
        if times.scheduled is not None:
            lab(self.queue).observe(times.scheduled - times.arrival)
            lab(self.inference).observe(times.finished - times.scheduled)
            if times.first_token is not None:
                lab(self.prefill).observe(times.first_token - times.scheduled)
        if times.first_token is not None:
            lab(self.decode).observe(times.finished - times.first_token)
            if times.num_output > 1:
                gap = (times.finished - times.first_token) / (times.num_output - 1)
                lab(self.req_tpot).observe(gap)
        reason = times.reason if times.reason in FINISHED_REASONS else "error"
        self.requests_ok.labels(**self.engines[e], finished_reason=reason).inc()
        self._group_done(times)

    def _group_done(self, times: RequestTimes) -> None:
        """vllm:request_max_num_generation_tokens, once all of a request's n samples end."""
        left, most = self._groups.pop(times.group, [times.n, 0])
        left, most = left - 1, max(most, times.num_output)
        if left > 0:
            self._groups[times.group] = [left, most]
        else:
            self.label(self.req_max_gen, times.engine).observe(most)

    def observe_itl(self, gap: float, engine: int = 0) -> None:
        self.label(self.itl, engine).observe(gap)
        self.label(self.tpot, engine).observe(gap)  # NOTE: vLLM's older name of the same gaps

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass(frozen=True)
class RequestTimes:
    """A finished request's clock readings (time.monotonic) and token counts."""

    arrival: float
    scheduled: float | None  # first scheduled
    first_token: float | None
    finished: float
    num_prompt: int
    num_output: int
    reason: str | None  # stop / length / abort / error
    group: str = ""  # the request the sample belongs to (its n samples share it)
    n: int = 1  # samples in that request
    engine: int = 0  # the engine core (data-parallel rank) that served it


def _advance(last: dict[str, int], child, key: str, value: int) -> None:
    """Move a counter child by the difference since the last refresh."""
    delta = value - last.get(key, 0)
    if delta > 0:
        child.inc(delta)
    last[key] = max(value, last.get(key, 0)) if delta >= 0 else value
