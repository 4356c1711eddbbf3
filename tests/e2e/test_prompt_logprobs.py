"""Prompt logprobs (`SamplingParams.prompt_logprobs`) equal transformers' fp32
log_softmax over the same prompt: single and batched, chunked prefill, and with
prefix caching on (a repeated request still gets every prompt position)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from laneserve import LLM, SamplingParams
from tests.e2e.test_tiny_models import mixed_prompts
from tests.tiny_models import _cached_model

TOP = 3


def hf_prompt_logprobs(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    """[L - 1, V]: log_softmax of the logits at positions 0..L-2 (fp32)."""
    model = _cached_model(str(model_dir))
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def check(model_dir: Path, prompt: list[int], got: list | None, top_n: int = TOP) -> None:
    """Each position holds exactly its own top `top_n` plus the prompt token."""
    assert got is not None and len(got) == len(prompt)
    assert got[0] is None
    want = hf_prompt_logprobs(model_dir, prompt)
    for pos in range(1, len(prompt)):
        entry, ref = got[pos], want[pos - 1]
        token = prompt[pos]
        assert token in entry, f"position {pos}: the prompt token is missing"
        assert abs(entry[token].logprob - ref[token].item()) < 1e-4, f"position {pos}"
        assert entry[token].rank == int((ref > ref[token]).sum()) + 1
        top = torch.topk(ref, top_n)
        for tid, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert tid in entry and abs(entry[tid].logprob - value) < 1e-4
        assert set(entry) == {*top.indices.tolist(), token}, f"position {pos}: extra entries"


def generate(llm: LLM, prompts: list[list[int]], max_tokens: int = 2) -> list:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, prompt_logprobs=TOP)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_single_and_batched(tiny_models: dict[str, Path]) -> None:
    d = tiny_models["llama"]
    prompts = mixed_prompts(5, seed=11, lo=1, hi=40)
    with LLM(str(d), dtype="float32") as llm:
        (single,) = generate(llm, prompts[:1])
        check(d, prompts[0], single.prompt_logprobs)
        for p, out in zip(prompts, generate(llm, prompts), strict=True):
            check(d, p, out.prompt_logprobs)
        plain = llm.generate(
            [{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=2), use_tqdm=False
        )
        assert plain[0].prompt_logprobs is None


def test_each_request_gets_its_own_top_n(tiny_models: dict[str, Path]) -> None:
    """Requests asking for different `prompt_logprobs` share one prefill step; each
    gets its own number of top entries, not the step's largest."""
    d = tiny_models["llama"]
    prompts = mixed_prompts(3, seed=16, lo=8, hi=20)
    tops = [0, 1, 6]
    params = [SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k) for k in tops]
    with LLM(str(d), dtype="float32") as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.get_stats()["num_steps"] == 1  # all three prefilled in one step
    for p, out, k in zip(prompts, outs, tops, strict=True):
        check(d, p, out.prompt_logprobs, top_n=k)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prefill(tiny_models: dict[str, Path], async_scheduling: bool) -> None:
    d = tiny_models["qwen2"]
    prompts = mixed_prompts(3, seed=12, lo=30, hi=60)
    with LLM(
        str(d),
        dtype="float32",
        max_num_batched_tokens=16,
        max_num_seqs=4,
        async_scheduling=async_scheduling,
    ) as llm:
        outs = generate(llm, prompts)
        assert llm.get_stats()["num_prefill_chunks"] > 1
    for p, out in zip(prompts, outs, strict=True):
        check(d, p, out.prompt_logprobs)


def test_prefix_cache_does_not_skip_prompt_logprobs(tiny_models: dict[str, Path]) -> None:
    d = tiny_models["llama"]
    prompt = mixed_prompts(1, seed=13, lo=50, hi=50)[0]
    with LLM(str(d), dtype="float32", enable_prefix_caching=True) as llm:
        first = generate(llm, [prompt])[0]
        second = generate(llm, [prompt])[0]
        assert second.num_cached_tokens == 0  # it computed every position again
        plain = llm.generate(
            [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False
        )
        assert plain[0].num_cached_tokens > 0  # requests without them still hit
    check(d, prompt, first.prompt_logprobs)
    check(d, prompt, second.prompt_logprobs)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_keeps_prompt_logprobs_and_tokens(
    tiny_models: dict[str, Path], async_scheduling: bool
) -> None:
    """Recomputed prefills after preemption send the same positions again: the
    request keeps one entry per position, and the generated tokens are those of a
    run without prompt logprobs."""
    d = tiny_models["llama"]
    prompts = mixed_prompts(6, seed=14, lo=10, hi=30)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    with_lp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=TOP)
    with LLM(
        str(d),
        dtype="float32",
        block_size=4,
        num_kv_blocks=40,
        max_model_len=64,
        async_scheduling=async_scheduling,
    ) as llm:
        batch = [{"prompt_token_ids": p} for p in prompts]
        outs = llm.generate(batch, with_lp, use_tqdm=False)
        assert llm.get_stats()["num_preemptions"] > 0
        plain = llm.generate(batch, greedy, use_tqdm=False)
    for p, out, ref in zip(prompts, outs, plain, strict=True):
        check(d, p, out.prompt_logprobs)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_with_ngram_speculation(tiny_models: dict[str, Path]) -> None:
    """Prefill rows asking for prompt logprobs share steps with speculative decodes;
    the decodes' tokens are those of the run without speculation."""
    d = tiny_models["llama"]
    loop = [11, 12, 13, 14, 15] * 6
    prompts = [loop, *mixed_prompts(3, seed=15, lo=5, hi=30)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=TOP)
    batch = [{"prompt_token_ids": p} for p in prompts]
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with LLM(str(d), dtype="float32", speculative_config=spec) as llm:
        outs = llm.generate(batch, params, use_tqdm=False)
        assert llm.get_stats()["spec_num_drafts"] > 0
    with LLM(str(d), dtype="float32") as llm:
        plain = llm.generate(batch, params, use_tqdm=False)
    for p, out, ref in zip(prompts, outs, plain, strict=True):
        check(d, p, out.prompt_logprobs)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
