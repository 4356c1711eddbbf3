"""`LLM(model, data_parallel_size=2, enable_expert_parallel=True)`: two ranks, each with
its scheduler, KV cache and worker process, the routed experts divided between them and
the ranks stepping in lock step. Greedy tokens equal one device's; a rank with nothing
to run takes part in every exchange; a worker's death restarts both ranks."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from laneserve import LLM, SamplingParams
from laneserve.core.lockstep import PEER_DIED, LockstepCore
from laneserve.engine_args import EngineArgs
from laneserve.frontend.engine import LLMEngine
from tests.e2e.test_tiny_models import mixed_prompts, run
from tests.models.tiny_deepseek_v32 import build_copying_mtp, build_tiny_deepseek_v32
from tests.tiny_models import add_mtp_layer, build_tiny_deepseek, hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
EP: dict = {"data_parallel_size": 2, "enable_expert_parallel": True, "worker_mode": "process"}


@pytest.fixture(scope="module")
def v3_mtp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = build_tiny_deepseek(tmp_path_factory.mktemp("ep") / "v3", 3, seed=3)
    return add_mtp_layer(d, seed=4)


def assert_equals_one_device(
    model: Path, prompts: list[list[int]], kw: dict, drafts: bool = False
) -> None:
    """Greedy tokens with expert parallelism (engaged, both ranks served) == one device's;
    `drafts`: every rank also proposed drafts and had some accepted."""
    with LLM(str(model), **kw) as llm:
        want = run(llm, prompts, GREEDY)
    with LLM(str(model), **EP, **kw) as llm:
        core = engaged(llm)
        got = run(llm, prompts, GREEDY)
        assert min(core.router.routed) >= 1
        for rank in core.ranks if drafts else ():
            stats = rank.scheduler.stats
            assert stats.num_drafts > 0 and stats.num_accepted > 0
    assert got == want


def engaged(llm: LLM) -> LockstepCore:
    """Lock step, and each rank holding its half of the routed experts."""
    core = llm.engine.core
    assert isinstance(core, LockstepCore)
    assert [r.ready.local_experts for r in core.ranks] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    return core


@pytest.mark.slow
def test_v3_mtp_async_equals_one_device_and_an_idle_rank_steps(v3_mtp: Path) -> None:
    """MTP k = 2 with async scheduling: the drafts' MoE layer joins the exchanges; one
    request alone leaves rank 1 with empty steps only (it must not hang)."""
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    prompts = mixed_prompts(3, seed=6)
    kw: dict = {"dtype": "float32", "async_scheduling": True, "speculative_config": spec}
    with LLM(str(v3_mtp), **kw) as llm:
        want = run(llm, prompts, GREEDY)
    with LLM(str(v3_mtp), **EP, **kw) as llm:
        core = engaged(llm)
        alone = run(llm, prompts[:1], GREEDY)
        idle = core.ranks[1].scheduler.stats
        assert idle.num_generation_tokens == 0 and idle.num_steps > 0  # empty steps only
        got = run(llm, prompts, GREEDY)
        assert min(core.router.routed) >= 1
        for rank in core.ranks:  # speculation engaged on each rank
            assert rank.scheduler.stats.num_drafts > 0
        # every rank ran every step: rank 1's steps include the empty ones
        steps = [r.scheduler.stats.num_steps for r in core.ranks]
        assert steps[0] == steps[1]
    assert alone == want[:1] and got == want


@pytest.mark.slow
def test_v4_equals_one_device(tmp_path: Path) -> None:
    """V4 in the release layout: its hash-routed layers (routed by token id where the
    token lives), its MTP layer (k = 2), prompts past the compression rates."""
    from tests.models.test_deepseek_v4 import LENGTHS, prompts_of
    from tests.models.tiny_deepseek_v4 import (
        add_v4_mtp_layer,
        build_tiny_deepseek_v4,
        to_release_layout,
    )

    hf = build_tiny_deepseek_v4(tmp_path / "v4", seed=0)
    d = add_v4_mtp_layer(to_release_layout(hf, tmp_path / "release"), seed=7)
    prompts = prompts_of(LENGTHS, seed=0)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    kw: dict = {"dtype": "float32", "async_scheduling": True, "speculative_config": spec}
    assert_equals_one_device(d, prompts, kw)


@pytest.mark.slow
def test_v32_equals_one_device(tmp_path: Path) -> None:
    """V3.2: sparse attention over the indexer's selection, its MoE divided."""
    d = build_tiny_deepseek_v32(tmp_path / "v32", seed=0, index_topk=6)
    prompts = mixed_prompts(4, seed=2)
    assert_equals_one_device(d, prompts, {"dtype": "float32", "async_scheduling": True})


@pytest.mark.slow
def test_v32_mtp_equals_one_device(tmp_path: Path) -> None:
    """V3.2's MTP layer (k = 2; a MoE copy of the target's layer, so its drafts are
    mostly accepted): the drafts' MoE layer joins the exchanges on each rank."""
    src = build_tiny_deepseek_v32(tmp_path / "v32", seed=0, index_topk=6)
    d = build_copying_mtp(src, tmp_path / "copy")
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    kw: dict = {"dtype": "float32", "async_scheduling": True, "speculative_config": spec}
    assert_equals_one_device(d, mixed_prompts(4, seed=2, lo=8, hi=40), kw, drafts=True)


@pytest.mark.slow
def test_killed_worker_fails_every_request_and_the_ranks_restart_together(v3_mtp: Path) -> None:
    args = EngineArgs(model=str(v3_mtp), dtype="float32", **EP)
    eng = LLMEngine(args.create_config())
    long = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    try:
        core = eng.core
        assert isinstance(core, LockstepCore)
        for i in range(4):
            eng.add_request(f"r{i}", [5 + i, 6, 7, 8], long)
        states = [s for g in eng.groups.values() for s in g]
        for _ in range(4):
            eng.step()
        victim = core.ranks[1].client.process.pid  # type: ignore[attr-defined]
        survivor = core.ranks[0].client.process.pid  # type: ignore[attr-defined]
        os.kill(victim, signal.SIGKILL)
        while eng.has_unfinished:
            eng.step()
        for s in states:  # both ranks' requests: the other rank waits on the dead one
            assert s.finish_reason == "error", s.error
        errors = {s.request.dp_rank: s.error or "" for s in states}
        assert "died" in errors[1] and (PEER_DIED in errors[0] or "died" in errors[0])
        prompt = [9, 10, 11]
        eng.add_request("after", prompt, SamplingParams(temperature=0, max_tokens=8))
        eng.add_request("after2", [9, 10, 12], SamplingParams(temperature=0, max_tokens=8))
        after = [s for g in eng.groups.values() for s in g if s.request.request_id == "after"]
        while eng.has_unfinished or core.restart_pending:
            eng.step()
        assert [r.num_worker_restarts for r in core.ranks] == [1, 1]
        pids = [r.client.process.pid for r in core.ranks]  # type: ignore[attr-defined]
        assert victim not in pids and survivor not in pids
        assert core.healthy and after[0].token_ids == hf_greedy(v3_mtp, prompt, 8)
    finally:
        eng.shutdown()


def test_refusals() -> None:
    with pytest.raises(ValueError, match="worker mode 'process'"):
        EngineArgs(
            model="m", data_parallel_size=2, enable_expert_parallel=True, worker_mode="thread"
        ).create_config()
    tree = {"method": "mtp", "num_speculative_tokens": 2, "speculative_token_tree": "[(0,), (1,)]"}
    with pytest.raises(ValueError, match="speculative_token_tree with enable_expert_parallel"):
        EngineArgs(model="m", speculative_config=tree, **EP).create_config()
    with pytest.raises(ValueError, match="enable_expert_parallel must be a boolean"):
        EngineArgs(model="m", data_parallel_size=2, enable_expert_parallel="yes").create_config()  # type: ignore[arg-type]
    # one rank: nothing to divide, the plain path
    cfg = EngineArgs(model="m", enable_expert_parallel=True).create_config()
    assert cfg.parallel.expert_parallel_size == 1


@pytest.mark.slow  # two worker starts that fail; the config refusals above stay quick
def test_a_family_without_experts_and_experts_that_do_not_divide(
    tiny_models: dict[str, Path], v3_mtp: Path
) -> None:
    with pytest.raises(ValueError, match="the llama family has no expert-parallel model"):
        LLM(str(tiny_models["llama"]), dtype="float32", **EP)
    with pytest.raises(ValueError, match="does not divide the model's 8 routed experts"):
        LLM(str(v3_mtp), dtype="float32", **{**EP, "data_parallel_size": 3})


def test_cli_flag() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(["--data-parallel-size", "2", "--enable-expert-parallel"])
    assert ns.enable_expert_parallel is True and ns.data_parallel_size == 2
