"""Greedy output of laneserve == transformers `generate` (fp32), token for token, on
tiny random DeepSeek V3 / V2 checkpoints: single and mixed-length batches (sync and
async), chunked prefill, prefix-cache hits and preemption."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from laneserve import LLM, SamplingParams
from laneserve.model.registry import open_weights
from tests.e2e.test_tiny_models import mixed_prompts, run
from tests.tiny_models import hf_greedy


def check_against_hf(d: Path, prompts: list[list[int]], got: list[list[int]], n: int) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the reference runs beside laneserve's threads
    try:
        for p, g in zip(prompts, got, strict=True):
            assert g == hf_greedy(d, p, n), f"prompt of {len(p)} tokens diverged"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("version", ["v3", "v2"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_single_and_batched_match_hf(
    deepseek_models: dict[str, Path], version: str, async_scheduling: bool
) -> None:
    d = deepseek_models[version]
    with LLM(str(d), dtype="float32", async_scheduling=async_scheduling) as llm:
        single = mixed_prompts(1, seed=0)
        check_against_hf(d, single, run(llm, single), 24)
        batch = mixed_prompts(6, seed=1)
        check_against_hf(d, batch, run(llm, batch), 24)


@pytest.mark.parametrize("chunk", [1, 5, 13])
def test_chunked_prefill_matches_hf(deepseek_models: dict[str, Path], chunk: int) -> None:
    d = deepseek_models["v3"]
    prompts = mixed_prompts(3, seed=2, lo=14, hi=30)
    with LLM(str(d), dtype="float32", max_num_batched_tokens=chunk, max_num_seqs=3) as llm:
        got = run(llm, prompts)
        assert llm.get_stats()["num_prefill_chunks"] > len(prompts)
    check_against_hf(d, prompts, got, 24)


def test_prefix_cache_hit_equals_cold(deepseek_models: dict[str, Path]) -> None:
    d = deepseek_models["v3"]
    shared = mixed_prompts(1, seed=3, lo=40, hi=40)[0]
    prompts = [shared + tail for tail in mixed_prompts(3, seed=4, lo=1, hi=12)]
    with LLM(str(d), dtype="float32") as llm:
        cold = run(llm, prompts)
        assert run(llm, prompts) == cold  # second run: served from the prefix cache
        assert llm.get_stats()["prefix_cache_hits"] > 0
    check_against_hf(d, prompts, cold, 24)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_matches_hf(deepseek_models: dict[str, Path], async_scheduling: bool) -> None:
    d = deepseek_models["v3"]
    prompts = mixed_prompts(5, seed=5, lo=10, hi=30)
    with LLM(
        str(d),
        dtype="float32",
        block_size=4,
        num_kv_blocks=40,
        max_model_len=64,
        enable_prefix_caching=False,
        async_scheduling=async_scheduling,
    ) as llm:
        got = run(llm, prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        stats = llm.get_stats()
        assert stats["num_preemptions"] > 0
        assert stats["num_free_blocks"] == 40
    check_against_hf(d, prompts, got, 30)


def test_torch_fallback_kernels_match_hf(deepseek_models: dict[str, Path]) -> None:
    d = deepseek_models["v3"]
    prompts = mixed_prompts(3, seed=6)
    with LLM(str(d), dtype="float32", use_kernels=False) as llm:
        got = run(llm, prompts)
    check_against_hf(d, prompts, got, 24)


def test_full_size_latent_decodes_on_the_paged_kernel(tmp_path: Path) -> None:
    """DeepSeek V3's own latent size (kv_lora_rank 512 + rope 64 = 576 values per entry)
    takes the kernels' paged attention in decode, and greedy output matches transformers."""
    from laneserve.kernels import get_kernels
    from laneserve.model.deepseek.model import DeepseekModel
    from laneserve.model.loader import resolve_checkpoint
    from tests.tiny_models import build_tiny_deepseek

    d = build_tiny_deepseek(tmp_path / "v3", 3, seed=5, kv_lora_rank=512, qk_rope_head_dim=64)
    cpu = torch.device("cpu")
    ckpt = resolve_checkpoint(str(d), "float32", cpu)
    assert ckpt.arch.deepseek.latent_dim == 576
    store = open_weights(ckpt, cpu, torch.float32)
    model = DeepseekModel(ckpt.arch, get_kernels(cpu), store, cpu, torch.float32, 512)
    assert all(layer.attn.paged_decode for layer in model.layers)
    prompts = mixed_prompts(3, seed=7)
    with LLM(str(d), dtype="float32") as llm:
        got = run(llm, prompts)
    check_against_hf(d, prompts, got, 24)
