"""Metric values against what a scripted workload must produce: the offline engine
is stepped by hand, `ServerMetrics.refresh` runs after every step (as the server
does) and the server's per-delta recorder feeds the latency histograms."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from laneserve.engine_args import EngineArgs
from laneserve.entrypoints.api_server import _record
from laneserve.frontend.engine import LLMEngine
from laneserve.obs.metrics import ServerMetrics
from laneserve.sampling_params import SamplingParams
from tests.tiny_models import build_bigram_model, build_exact_mtp_head

NAME = "tiny"
LABELS = {"model_name": NAME, "engine": "0"}


class Probe:
    """An engine, its metrics, and the value of any sample by name."""

    def __init__(self, model: Path, **kw: object) -> None:
        args = EngineArgs(model=str(model), dtype="float32", async_scheduling=False, **kw)
        self.engine = LLMEngine(args.create_config())
        self.metrics = ServerMetrics(NAME)
        self.state = SimpleNamespace(metrics=self.metrics)
        self.clock: dict[int, float] = {}
        self.tokens: dict[str, list[int]] = {}

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        self.engine.add_request(rid, prompt, params)
        self.tokens[rid] = []

    def step(self) -> None:
        for d in self.engine.step():
            self.tokens[d.state.group_id] += d.token_ids
            _record(self.state, d, self.clock)
        self.metrics.refresh(self.engine)

    def value(self, name: str, **labels: str) -> float:
        v = self.metrics.registry.get_sample_value(f"vllm:{name}", {**LABELS, **labels})
        return 0.0 if v is None else v

    def gauges(self) -> tuple[float, float, float]:
        return (
            self.value("num_requests_running"),
            self.value("num_requests_waiting"),
            self.value("kv_cache_usage_perc"),
        )


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(n)] for n in lengths]


def test_gauges_counters_and_latency_counts(tiny_models: dict[str, Path]) -> None:
    """Sync, two running at most, 4-token blocks, no prefix cache: requests 0 and 1
    run first (3 tokens each), 2 and 3 wait for them (5 tokens each)."""
    probe = Probe(
        tiny_models["llama"],
        max_num_seqs=2,
        block_size=4,
        num_kv_blocks=64,
        max_model_len=64,
        enable_prefix_caching=False,
    )
    lengths, max_tokens = [6, 9, 5, 7], [3, 3, 5, 5]
    for i, p in enumerate(prompts(lengths, seed=1)):
        probe.add(f"r{i}", p, max_tokens[i])
    assert probe.gauges() == (0, 0, 0)
    seen = []
    for _ in range(8):
        probe.step()
        seen.append(probe.gauges())
    assert not probe.engine.has_unfinished
    # step 1: prefill of r0 and r1 (2 + 3 blocks for 6 and 9 prompt tokens); steps 2-3
    # decode them (positions 6..7 and 9..10 fit in those blocks); they finish after step 3.
    assert seen[0] == (2, 2, 5 / 64)
    assert seen[1] == (2, 2, 5 / 64)
    assert seen[2] == (0, 2, 0)
    # step 4: prefill of r2 and r3 (2 + 2 blocks); r3 reaches position 8 in step 6
    assert seen[3] == (2, 0, 4 / 64)
    assert seen[5] == (2, 0, 5 / 64)
    assert seen[7] == (0, 0, 0)
    assert probe.value("prompt_tokens_total") == sum(lengths)
    assert probe.value("generation_tokens_total") == sum(max_tokens)
    assert [len(t) for t in probe.tokens.values()] == max_tokens
    assert probe.value("num_preemptions_total") == 0
    assert probe.value("request_success_total", finished_reason="length") == 4
    assert probe.value("request_success_total", finished_reason="stop") == 0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds"):  # fmt: skip
        assert probe.value(f"{name}_count") == 4, name
    # r2 and r3 waited for r0 and r1 to finish: their queue time covers those steps
    assert probe.value("request_queue_time_seconds_sum") > 0
    assert probe.value("request_prompt_tokens_sum") == sum(lengths)
    assert probe.value("request_generation_tokens_sum") == sum(max_tokens)
    assert probe.value("request_generation_tokens_bucket", le="2.0") == 0
    assert probe.value("request_generation_tokens_bucket", le="5.0") == 4
    # one token per step per request: one gap per token after the first
    gaps = sum(n - 1 for n in max_tokens)
    assert probe.value("inter_token_latency_seconds_count") == gaps
    assert probe.value("time_per_output_token_seconds_count") == gaps
    assert probe.value("request_time_per_output_token_seconds_count") == 4
    # one observation per engine step, of the tokens it computed
    stats = probe.engine.stats()
    assert probe.value("iteration_tokens_total_count") == stats["num_steps"] == 8
    assert probe.value("iteration_tokens_total_sum") == stats["num_scheduled_tokens"]
    assert probe.metrics.registry.get_sample_value(
        "vllm:cache_config_info",
        {**LABELS, "block_size": "4", "num_gpu_blocks": "64",
         "enable_prefix_caching": "False"},
    ) == 1  # fmt: skip
    assert probe.value("e2e_request_latency_seconds_bucket", le="+Inf") == 4
    probe.engine.shutdown()


def test_preemption_counter_and_recomputed_prompt_tokens(tiny_models: dict[str, Path]) -> None:
    """Two requests that each end in 4 blocks of 4 tokens, 6 blocks in all: the later
    one must be preempted and its tokens computed again."""
    probe = Probe(tiny_models["llama"], block_size=4, num_kv_blocks=6, max_model_len=24)
    ps = prompts([4, 4], seed=2)
    for i, p in enumerate(ps):
        probe.add(f"r{i}", p, 12)
    while probe.engine.has_unfinished:
        probe.step()
    stats = probe.engine.stats()
    preemptions = probe.value("num_preemptions_total")
    assert preemptions >= 1 and preemptions == stats["num_preemptions"]
    # a preempted request's prompt and outputs are prefilled again (the engine's
    # stats), but vLLM's prompt_tokens_total counts each request's prompt once
    assert stats["num_prompt_tokens"] > sum(len(p) for p in ps)
    assert probe.value("prompt_tokens_total") == sum(len(p) for p in ps)
    assert probe.value("generation_tokens_total") == 24
    assert probe.value("request_success_total", finished_reason="length") == 2
    assert probe.gauges() == (0, 0, 0)
    probe.engine.shutdown()


@pytest.fixture(scope="module")
def bigram(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("metrics-bigram")
    model = build_bigram_model(root / "llama", "llama", seed=4)
    exact = build_exact_mtp_head(model, root / "exact.safetensors")
    never = build_exact_mtp_head(model, root / "never.safetensors", [1])  # drafts token 1 only
    return model, exact, never


def test_speculative_counters_with_a_known_head(bigram: tuple[Path, Path, Path]) -> None:
    """The exact head, two drafts a step, 31 tokens: 1 from the prefill, then 10 steps
    of 2 accepted drafts + 1 bonus token: 20 drafts, all accepted, 10 token gaps."""
    model, exact, _ = bigram
    spec = {"method": "mtp", "num_speculative_tokens": 2, "draft_weights": str(exact)}
    probe = Probe(model, speculative_config=spec)
    probe.add("r0", prompts([9], seed=3)[0], 31)
    while probe.engine.has_unfinished:
        probe.step()
    assert len(probe.tokens["r0"]) == 31
    assert probe.value("spec_decode_num_draft_tokens_total") == 20
    assert probe.value("spec_decode_num_accepted_tokens_total") == 20
    assert probe.value("spec_decode_num_drafts_total") == 10
    for pos in ("0", "1"):
        assert probe.value("spec_decode_num_accepted_tokens_per_pos_total", position=pos) == 10
    assert probe.value("generation_tokens_total") == 31
    assert probe.value("inter_token_latency_seconds_count") == 10
    assert probe.value("request_success_total", finished_reason="length") == 1
    probe.engine.shutdown()


def test_speculative_counters_when_nothing_is_accepted(bigram: tuple[Path, Path, Path]) -> None:
    """A head that only drafts token 1 (never the bigram model's next token here):
    one draft per decode step but the last (one token left: no room for a draft),
    none accepted, one token per step."""
    model, _, never = bigram
    spec = {"method": "mtp", "num_speculative_tokens": 1, "draft_weights": str(never)}
    probe = Probe(model, speculative_config=spec)
    probe.add("r0", prompts([9], seed=3)[0], 12)
    while probe.engine.has_unfinished:
        probe.step()
    assert 1 not in probe.tokens["r0"]
    assert probe.value("spec_decode_num_draft_tokens_total") == 10
    assert probe.value("spec_decode_num_accepted_tokens_total") == 0
    assert probe.value("spec_decode_num_drafts_total") == 10
    assert probe.value("spec_decode_num_accepted_tokens_per_pos_total", position="0") == 0
    assert probe.value("inter_token_latency_seconds_count") == 11
    probe.engine.shutdown()


# every series a vLLM dashboard reads, with the model_name label, from the start
VLLM_SERIES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total", "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_count", "vllm:time_per_output_token_seconds_count",
    "vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
    "vllm:request_decode_time_seconds_count", "vllm:request_inference_time_seconds_count",
    "vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_count",
    "vllm:iteration_tokens_total_count", "laneserve:num_worker_restarts_total",
]  # fmt: skip


def test_every_series_is_exported_at_zero_before_any_request() -> None:
    m = ServerMetrics(NAME)
    for name in VLLM_SERIES:
        assert m.registry.get_sample_value(name, LABELS) == 0, name
    for reason in ("stop", "length", "abort", "error"):
        labels = {**LABELS, "finished_reason": reason}
        assert m.registry.get_sample_value("vllm:request_success_total", labels) == 0
    assert b"laneserve:" not in m.render().replace(b"laneserve:num_worker_restarts", b"")
