"""Greedy output of laneserve == transformers `generate` (fp32), token for token,
on tiny random Llama / Qwen2 / Qwen3 checkpoints: single prompts, 8 mixed-length
prompts in one batch, chunked prefill, prefix-cache hits and preemption."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from laneserve import LLM, SamplingParams
from tests.tiny_models import MISTRAL_WINDOW, build_tiny_model, hf_greedy

FAMILIES = ["llama", "qwen2", "qwen3"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def mixed_prompts(n: int, seed: int, lo: int = 2, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def check_against_hf(
    model_dir: Path, prompts: list[list[int]], got: list[list[int]], n: int
) -> None:
    for p, g in zip(prompts, got, strict=True):
        assert g == hf_greedy(model_dir, p, n), f"prompt of {len(p)} tokens diverged"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_single_and_batched_match_hf(
    tiny_models: dict[str, Path], family: str, async_scheduling: bool
) -> None:
    d = tiny_models[family]
    with LLM(str(d), dtype="float32", async_scheduling=async_scheduling) as llm:
        single = mixed_prompts(1, seed=0)
        check_against_hf(d, single, run(llm, single), 24)
        batch = mixed_prompts(8, seed=1)
        check_against_hf(d, batch, run(llm, batch), 24)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_matches_hf(tiny_models: dict[str, Path], family: str) -> None:
    d = tiny_models[family]
    with LLM(str(d), dtype="float32", max_num_batched_tokens=16, max_num_seqs=4) as llm:
        prompts = mixed_prompts(4, seed=2, lo=30, hi=70)
        got = run(llm, prompts)
        assert llm.get_stats()["num_prefill_chunks"] > 1
    check_against_hf(d, prompts, got, 24)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_cache_hits_match_hf(tiny_models: dict[str, Path], family: str) -> None:
    d = tiny_models[family]
    shared = mixed_prompts(1, seed=3, lo=40, hi=40)[0]
    prompts = [shared + tail for tail in mixed_prompts(4, seed=4, lo=1, hi=12)]
    with LLM(str(d), dtype="float32") as llm:
        first = run(llm, prompts)
        assert run(llm, prompts) == first  # second run: served from the prefix cache
        stats = llm.get_stats()
        assert stats["prefix_cache_hits"] > 0
    check_against_hf(d, prompts, first, 24)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_matches_hf(
    tiny_models: dict[str, Path], family: str, async_scheduling: bool
) -> None:
    d = tiny_models[family]
    prompts = mixed_prompts(6, seed=5, lo=10, hi=30)
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


def test_torch_fallback_kernels_match_hf(tiny_models: dict[str, Path]) -> None:
    d = tiny_models["qwen2"]
    prompts = mixed_prompts(3, seed=6)
    with LLM(str(d), dtype="float32", use_kernels=False) as llm:
        got = run(llm, prompts)
    check_against_hf(d, prompts, got, 24)


def test_text_prompts_chat_and_stop_strings(tiny_models: dict[str, Path]) -> None:
    d = tiny_models["llama"]
    with LLM(str(d), dtype="float32") as llm:
        out = llm.generate(
            "The old lighthouse", SamplingParams(temperature=0, max_tokens=16), use_tqdm=False
        )[0]
        full = out.outputs[0]
        assert full.token_ids and full.finish_reason in ("length", "stop")
        assert full.text == llm.get_tokenizer().decode(full.token_ids)
        # a stop string taken from the middle of that text ends the output before it
        text = full.text
        stop = next(
            (text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].strip()), None
        )
        assert stop is not None, f"no stop string found in {text!r}"
        cut = llm.generate(
            "The old lighthouse",
            SamplingParams(temperature=0, max_tokens=16, stop=[stop]),
            use_tqdm=False,
        )[0].outputs[0]
        assert cut.finish_reason == "stop" and cut.stop_reason == stop
        assert cut.text == text[: text.index(stop)]
        chat = llm.chat(
            [{"role": "user", "content": "hello"}],
            SamplingParams(temperature=0, max_tokens=4),
            use_tqdm=False,
        )
        assert len(chat[0].outputs[0].token_ids) >= 1


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny Mistral (sliding window 40) and Llama with linear rope scaling (factor 4)."""
    root = tmp_path_factory.mktemp("variants")
    return {
        "mistral": build_tiny_model(root / "mistral", "mistral", seed=7),
        "llama-linear": build_tiny_model(root / "llama-linear", "llama-linear", seed=9),
    }


def test_mistral_within_its_sliding_window_matches_hf(variants: dict[str, Path]) -> None:
    """Within the window, sliding-window attention is causal attention: laneserve caps
    max_model_len to the window and matches transformers up to its last position."""
    d = variants["mistral"]
    prompts = mixed_prompts(4, seed=8, lo=8, hi=20)
    n = MISTRAL_WINDOW - max(len(p) for p in prompts)  # the longest reaches the window's end
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    with LLM(str(d), dtype="float32") as llm:
        assert llm.engine.max_model_len == MISTRAL_WINDOW
        got = run(llm, prompts, params)
        with pytest.raises(ValueError, match="max_model_len is 40"):
            llm.generate({"prompt_token_ids": [5] * MISTRAL_WINDOW}, params, use_tqdm=False)
    check_against_hf(d, prompts, got, n)


def test_linear_rope_scaling_matches_hf(variants: dict[str, Path]) -> None:
    d = variants["llama-linear"]
    prompts = mixed_prompts(4, seed=9, lo=20, hi=60)
    with LLM(str(d), dtype="float32") as llm:
        got = run(llm, prompts)
    check_against_hf(d, prompts, got, 24)
