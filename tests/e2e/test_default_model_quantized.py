"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) with its weights kept
quantized gives exactly the greedy tokens and log-probabilities of the dequantized
fp32 weights (the native kernel's reference: the same math, docs/kernels.md)."""

from __future__ import annotations

import pytest

from laneserve import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def _greedy(mode: str) -> list[tuple[list[int], float | None]]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    with LLM(dtype="float32", gguf_weights=mode, max_model_len=256) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in outs]


# NOTE: slow (two loads of the real model, one of them dequantized to fp32); the same
# equality on a tiny GGUF runs by default (tests/models/test_gguf_quantized.py)
@pytest.mark.slow
def test_default_model_quantized_equals_dequantized_fp32() -> None:
    got = _greedy("quantized")
    assert all(len(tokens) == 24 and logprob is not None for tokens, logprob in got)
    assert got == _greedy("dequantized")


def _q8_greedy(**kwargs: object) -> tuple[list[list[int]], dict]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(gguf_weights="q8-dot", max_model_len=256, **kwargs) as llm:  # type: ignore[arg-type]
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        stats = llm.engine.stats()
    return [o.outputs[0].token_ids for o in outs], stats


# NOTE: slow: without avx512_vnni q8-dot runs its torch reference, minutes for the
# real model on two cores; the same check on a tiny GGUF runs by default
# (tests/models/test_gguf_quantized.py)
@pytest.mark.slow
def test_q8_dot_speculative_equals_plain() -> None:
    """Verify rows take the same int8 arithmetic as the decode rows they replace."""
    plain, _ = _q8_greedy(async_scheduling=False)
    spec, stats = _q8_greedy(
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    )
    assert stats["spec_num_drafts"] > 0 and stats["spec_num_accepted"] > 0, stats
    assert spec == plain
