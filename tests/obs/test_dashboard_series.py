"""The series vLLM's Grafana dashboards read all exist (with vLLM's labels), and
`vllm:prompt_tokens_total` counts every prompt token, cached ones included."""

from __future__ import annotations

from pathlib import Path

from laneserve.obs.metrics import RequestTimes, ServerMetrics
from tests.obs.test_metrics_values import LABELS, NAME, Probe, prompts

# The metric names in the PromQL of vLLM's example dashboards:
# - current: examples/observability/prometheus_grafana/grafana.json (vllm-project/vllm)
# - previous: examples/online_serving/prometheus_grafana/grafana.json and, before it,
#   examples/production_monitoring/grafana.json, which read the older names
#   (time_per_output_token_seconds, gpu/cpu_cache_usage_perc, num_requests_swapped).
CURRENT_DASHBOARD = [
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total", "vllm:inter_token_latency_seconds_bucket",
    "vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count",
    "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count", "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
]  # fmt: skip
PREVIOUS_DASHBOARD = [
    "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count", "vllm:gpu_cache_usage_perc",
    "vllm:cpu_cache_usage_perc", "vllm:num_requests_swapped",
]  # fmt: skip
# the prefix-cache series vLLM exports alongside (read by its other example panels)
PREFIX_CACHE = [
    "vllm:prompt_tokens_cached_total", "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
]  # fmt: skip


def _names(m: ServerMetrics) -> dict[str, list[dict[str, str]]]:
    out: dict[str, list[dict[str, str]]] = {}
    for family in m.registry.collect():
        for s in family.samples:
            out.setdefault(s.name, []).append(s.labels)
    return out


def test_dashboard_series_exist_with_vllm_labels() -> None:
    names = _names(ServerMetrics(NAME))
    for name in CURRENT_DASHBOARD + PREVIOUS_DASHBOARD + PREFIX_CACHE:
        assert name in names, name
        assert all(lab.get("model_name") == NAME for lab in names[name]), name
        assert all(lab.get("engine") == "0" for lab in names[name]), name
    sources = {lab["source"] for lab in names["vllm:prompt_tokens_by_source_total"]}
    assert sources == {"local_compute", "local_cache_hit"}


def test_prompt_tokens_count_cache_hits(tiny_models: Path | dict) -> None:
    """The second request repeats the first's prompt: the prefix cache serves all
    but its last block, and prompt_tokens_total still rises by the whole prompt."""
    probe = Probe(tiny_models["llama"], block_size=4, num_kv_blocks=64, max_model_len=64)
    (p,) = prompts([17], seed=5)
    probe.add("a", p, 2)
    while probe.engine.has_unfinished:
        probe.step()
    assert probe.value("prompt_tokens_total") == 17
    assert probe.value("prompt_tokens_cached_total") == 0
    probe.add("b", p, 2)
    while probe.engine.has_unfinished:
        probe.step()
    cached = probe.value("prompt_tokens_cached_total")
    assert cached == 16  # four full blocks
    assert probe.value("prompt_tokens_total") == 34
    assert probe.value("prefix_cache_hits_total") == cached
    assert probe.value("prompt_tokens_by_source_total", source="local_cache_hit") == cached
    assert probe.value("prompt_tokens_by_source_total", source="local_compute") == 34 - cached
    assert probe.value("gpu_cache_usage_perc") == probe.value("kv_cache_usage_perc")
    probe.engine.shutdown()


def test_max_generation_tokens_per_request() -> None:
    """One observation per request, once its n samples have all finished: the most
    tokens any of them generated."""
    m = ServerMetrics(NAME)

    def done(group: str, n: int, tokens: int) -> None:
        m.observe_request(RequestTimes(0.0, 0.0, 0.1, 1.0, 5, tokens, "length", group, n))

    done("r1", 3, 4)
    done("r1", 3, 9)
    assert m.registry.get_sample_value("vllm:request_max_num_generation_tokens_count", LABELS) == 0
    done("r1", 3, 2)
    done("r2", 1, 5)
    get = m.registry.get_sample_value
    assert get("vllm:request_max_num_generation_tokens_count", LABELS) == 2
    assert get("vllm:request_max_num_generation_tokens_sum", LABELS) == 14
