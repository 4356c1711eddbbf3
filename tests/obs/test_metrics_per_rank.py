"""Per-rank metrics with `data_parallel_size` 2: every series exists for engine "0" and
engine "1" (vLLM's label for an engine core's index), and each request's counts land on
the rank that served it, prefix-cache hits included."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from laneserve.core.data_parallel import DataParallelCore
from laneserve.engine_args import EngineArgs
from laneserve.entrypoints.api_server import _record
from laneserve.frontend.engine import LLMEngine
from laneserve.obs.metrics import ServerMetrics
from laneserve.sampling_params import SamplingParams

NAME = "tiny"
BS = 4


def value(m: ServerMetrics, name: str, engine: int, **labels: str) -> float:
    v = m.registry.get_sample_value(
        f"vllm:{name}", {"model_name": NAME, "engine": str(engine), **labels}
    )
    return 0.0 if v is None else v


def test_every_series_exists_per_rank_at_zero() -> None:
    m = ServerMetrics(NAME, num_engines=2)
    for e in (0, 1):
        for name in ("num_requests_running", "generation_tokens_total", "prefix_cache_hits_total"):
            assert (
                m.registry.get_sample_value(f"vllm:{name}", {"model_name": NAME, "engine": str(e)})
                == 0
            ), (name, e)
        assert value(m, "request_success_total", e, finished_reason="error") == 0
    assert m.registry.get_sample_value(
        "vllm:num_requests_running", {"model_name": NAME, "engine": "2"}
    ) is None  # no third engine  # fmt: skip


def test_counts_land_on_the_serving_rank(tiny_models: dict[str, Path]) -> None:
    args = EngineArgs(
        model=str(tiny_models["llama"]), dtype="float32", async_scheduling=False,
        worker_mode="thread", data_parallel_size=2, block_size=BS, num_kv_blocks=64,
        max_model_len=64,
    )  # fmt: skip
    eng = LLMEngine(args.create_config())
    m = ServerMetrics(NAME, num_engines=2)
    state = SimpleNamespace(metrics=m)
    clock: dict[int, float] = {}
    try:
        core = eng.core
        assert isinstance(core, DataParallelCore)
        shared = [5, 6, 7, 8, 9, 10, 11, 12]  # two full blocks
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        eng.add_request(
            "b", [30, 31, 32, 33, 34], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        )
        eng.add_request("a", [*shared, 20], params)  # rank 1: less pending

        def drain() -> None:
            while eng.has_unfinished:
                for d in eng.step():
                    _record(state, d, clock)
                m.refresh(eng)

        m.refresh(eng)
        assert value(m, "num_requests_waiting", 0) == 1
        assert value(m, "num_requests_waiting", 1) == 1
        drain()
        # the shared prefix is cached on rank 1 only: the next ones go there and hit it
        # (over rank 0, which wins ties of load, and then over the less loaded rank 0)
        eng.add_request("c", [*shared, 21], params)
        eng.add_request("d", [*shared, 22], params)
        ranks = {s.request.request_id: s.request.dp_rank for g in eng.groups.values() for s in g}
        assert ranks == {"c": 1, "d": 1}
        drain()
        assert value(m, "prefix_cache_hits_total", 1) == 2 * len(shared)
        assert value(m, "prefix_cache_hits_total", 0) == 0
        assert value(m, "request_success_total", 1, finished_reason="length") == 3
        assert value(m, "request_success_total", 0, finished_reason="length") == 1
        assert value(m, "generation_tokens_total", 1) == 9
        assert value(m, "generation_tokens_total", 0) == 6
        assert value(m, "e2e_request_latency_seconds_count", 0) == 1
        assert value(m, "inter_token_latency_seconds_count", 0) == 5
        assert value(m, "num_requests_running", 0) == value(m, "num_requests_running", 1) == 0
        for e in (0, 1):
            labels = {"block_size": str(BS), "num_gpu_blocks": "64"}
            assert value(m, "cache_config_info", e, enable_prefix_caching="True", **labels) == 1
        assert core.router.by_prefix == 2
    finally:
        eng.shutdown()
