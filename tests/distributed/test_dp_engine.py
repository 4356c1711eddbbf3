"""`LLM(model, data_parallel_size=2)`: two engine cores, each with its own scheduler, KV
cache and worker; greedy tokens equal one core's, and both ranks serve."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from laneserve import LLM, SamplingParams
from laneserve.core.data_parallel import DataParallelCore
from laneserve.core.engine_core import EngineCore
from laneserve.engine_args import EngineArgs
from laneserve.frontend.engine import LLMEngine
from tests.e2e.test_tiny_models import mixed_prompts, run
from tests.tiny_models import add_mtp_layer, build_tiny_deepseek, hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def both_ranks_served(llm: LLM, num_requests: int) -> None:
    core = llm.engine.core
    assert isinstance(core, DataParallelCore)
    assert sum(core.router.routed) == num_requests and min(core.router.routed) >= 1
    for rank in core.ranks:
        assert rank.scheduler.stats.num_generation_tokens > 0


def test_two_ranks_generate_what_one_does_llama(tiny_models: dict[str, Path]) -> None:
    d = str(tiny_models["llama"])
    prompts = mixed_prompts(6, seed=4)
    with LLM(d, dtype="float32") as llm:
        assert isinstance(llm.engine.core, EngineCore)  # D = 1: the plain core, no router
        want = run(llm, prompts, GREEDY)
    with LLM(d, dtype="float32", data_parallel_size=2, async_scheduling=True) as llm:
        got = run(llm, prompts, GREEDY)
        both_ranks_served(llm, len(prompts))
        stats = llm.engine.stats()
        ranks = stats["data_parallel_ranks"]
        assert [r["num_routed"] for r in ranks] == llm.engine.core.router.routed
        assert sum(r["num_generation_tokens"] for r in ranks) == stats["num_generation_tokens"]
        assert stats["num_generation_tokens"] == 16 * len(prompts)
        assert stats["num_routed_by_prefix"] == llm.engine.core.router.by_prefix
    assert got == want
    assert got[0] == hf_greedy(Path(d), prompts[0], 16)


@pytest.fixture(scope="module")
def deepseek_mtp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = build_tiny_deepseek(tmp_path_factory.mktemp("ds") / "v3", 3, seed=3)
    return add_mtp_layer(d, seed=4)


@pytest.mark.slow
def test_two_ranks_with_mtp_generate_what_one_does_deepseek(deepseek_mtp: Path) -> None:
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    prompts = mixed_prompts(4, seed=6)
    kw: dict = {"dtype": "float32", "async_scheduling": True, "speculative_config": spec}
    with LLM(str(deepseek_mtp), **kw) as llm:
        want = run(llm, prompts, GREEDY)
    with LLM(str(deepseek_mtp), data_parallel_size=2, **kw) as llm:
        got = run(llm, prompts, GREEDY)
        both_ranks_served(llm, len(prompts))
        for rank in llm.engine.core.ranks:  # speculation engaged on each rank
            assert rank.scheduler.stats.num_drafts > 0
        assert llm.engine.stats()["spec_num_drafts"] > 0
    assert got == want


@pytest.fixture(scope="module")
def deepseek_v4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.models.tiny_deepseek_v4 import build_tiny_deepseek_v4

    return build_tiny_deepseek_v4(tmp_path_factory.mktemp("ds4") / "v4", seed=0)


@pytest.mark.slow
def test_two_ranks_generate_what_one_does_deepseek_v4(deepseek_v4: Path) -> None:
    """V4's cache kinds (sliding, compressed) and hash-routed MoE, per rank; prompts
    around the window and the compression rates."""
    from tests.models.test_deepseek_v4 import LENGTHS, prompts_of

    prompts = prompts_of(LENGTHS, seed=0)
    kw: dict = {"dtype": "float32", "async_scheduling": True}
    with LLM(str(deepseek_v4), **kw) as llm:
        want = run(llm, prompts, GREEDY)
    with LLM(str(deepseek_v4), data_parallel_size=2, **kw) as llm:
        got = run(llm, prompts, GREEDY)
        both_ranks_served(llm, len(prompts))
    assert got == want


@pytest.mark.slow
def test_killed_rank_fails_its_requests_only(tiny_models: dict[str, Path]) -> None:
    """Two worker processes; SIGKILL on rank 1's: its in-flight requests fail, rank 0's
    complete with the right tokens, and rank 1 restarts and serves again."""
    d = tiny_models["llama"]
    args = EngineArgs(model=str(d), dtype="float32", worker_mode="process", data_parallel_size=2)
    eng = LLMEngine(args.create_config())
    long = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    try:
        core = eng.core
        assert isinstance(core, DataParallelCore)
        prompts = [[5 + i, 6, 7, 8] for i in range(4)]
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, long)
        states = {s.request.request_id: s for g in eng.groups.values() for s in g}
        assert sorted(s.request.dp_rank for s in states.values()) == [0, 0, 1, 1]
        for _ in range(4):
            eng.step()
        victim = core.ranks[1].client.process.pid  # type: ignore[attr-defined]
        os.kill(victim, signal.SIGKILL)
        while eng.has_unfinished:
            eng.step()
        for rid, s in states.items():
            if s.request.dp_rank == 0:
                assert s.finish_reason == "length" and s.token_ids == hf_greedy(
                    d, prompts[int(rid[1:])], 120
                )
            else:
                assert s.finish_reason == "error" and "died" in (s.error or "")
        eng.add_request("after", [9, 10, 11], SamplingParams(temperature=0, max_tokens=8))
        eng.add_request("after2", [9, 10, 12], SamplingParams(temperature=0, max_tokens=8))
        while eng.has_unfinished or core.restart_pending:
            eng.step()
        assert core.ranks[1].num_worker_restarts == 1 and core.ranks[0].num_worker_restarts == 0
        assert core.ranks[1].client.process.pid != victim  # type: ignore[attr-defined]
        assert core.healthy
    finally:
        eng.shutdown()


@pytest.mark.parametrize("bad", [0, -1, "2", 1.5, True])
def test_bad_sizes_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="data_parallel_size must be"):
        EngineArgs(model="m", data_parallel_size=bad).create_config()  # type: ignore[arg-type]


def test_data_parallel_with_tensor_parallel_is_refused() -> None:
    with pytest.raises(ValueError, match="data_parallel_size > 1 with tensor_parallel_size > 1"):
        EngineArgs(
            model="m", data_parallel_size=2, tensor_parallel_size=2, worker_mode="process"
        ).create_config()


def test_cli_flag_parses_and_refuses_non_integers() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(["--data-parallel-size", "2"])
    assert EngineArgs.from_cli(ns).data_parallel_size == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["--data-parallel-size", "two"])


def test_each_cuda_rank_needs_its_own_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank r runs on cuda:r; a rank beyond the visible devices is refused by name (the
    count is patched: no CUDA device is needed to check the message)."""
    import torch

    from laneserve.worker.ranks import rank_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert rank_device(torch.device("cuda"), 0) == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"rank 1 needs its own CUDA device \(cuda:1\) but 1 are"):
        rank_device(torch.device("cuda"), 1)
    assert rank_device(torch.device("cpu"), 1) == torch.device("cpu")  # ranks share the host


@pytest.mark.slow
def test_idle_rank_death_restarts_while_health_says_so(tiny_models: dict[str, Path]) -> None:
    """Served (AsyncLLM): rank 1's worker dies while idle and rank 0 is mid-request. The
    death is seen by the process watch, not by a step; the restart still runs with
    health false (503), rank 0's request completes with the right tokens, and health
    is true again after."""
    import asyncio

    from laneserve.frontend.async_llm import AsyncLLM
    from tests.server.conftest import wait_for

    d = tiny_models["llama"]
    args = EngineArgs(model=str(d), dtype="float32", worker_mode="process", data_parallel_size=2)
    llm = AsyncLLM(args.create_config())
    llm.start()
    assert llm.wait_ready(300) and llm.load_error is None
    try:
        assert llm.engine is not None and isinstance(llm.engine.core, DataParallelCore)
        rank1 = llm.engine.core.ranks[1]
        client = rank1.client
        restart = client.restart  # type: ignore[attr-defined]
        healthy_at_restart: list[bool] = []

        def spy() -> None:
            healthy_at_restart.append(llm.healthy)
            restart()

        client.restart = spy  # type: ignore[attr-defined]
        victim = client.process.pid  # type: ignore[attr-defined]
        prompt = [5, 6, 7, 8]

        async def long_request() -> list[int]:
            tokens: list[int] = []
            params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            async for delta in llm.generate("long", prompt, params):
                if not tokens:
                    os.kill(victim, signal.SIGKILL)  # rank 1 holds no request
                tokens += delta.token_ids
            return tokens

        tokens = asyncio.run(long_request())
        wait_for(lambda: rank1.num_worker_restarts == 1, "rank 1 restarted")
        assert healthy_at_restart == [False]
        assert tokens == hf_greedy(d, prompt, 200)
        assert llm.engine.core.ranks[0].num_worker_restarts == 0
        wait_for(lambda: llm.healthy, "healthy after the restart")
    finally:
        llm.shutdown()


def test_one_client_for_several_ranks_is_refused() -> None:
    from laneserve.config import EngineConfig, ModelConfig, ParallelConfig
    from tests.fakes import FakeWorker

    cfg = EngineConfig(
        model=ModelConfig(model="fake"), parallel=ParallelConfig(data_parallel_size=2)
    )
    with pytest.raises(ValueError, match="one worker client given for data_parallel_size > 1"):
        LLMEngine(cfg, client=FakeWorker(64))
