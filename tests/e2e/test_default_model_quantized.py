"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) with its weights kept
quantized gives exactly the greedy tokens and log-probabilities of the dequantized
fp32 weights (the native kernel's reference: the same math, docs/kernels.md)."""

from __future__ import annotations

from laneserve import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def _greedy(mode: str) -> list[tuple[list[int], float | None]]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    with LLM(dtype="float32", gguf_weights=mode, max_model_len=256) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in outs]


def test_default_model_quantized_equals_dequantized_fp32() -> None:
    got = _greedy("quantized")
    assert all(len(tokens) == 24 and logprob is not None for tokens, logprob in got)
    assert got == _greedy("dequantized")
