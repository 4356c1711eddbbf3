"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF): laneserve fp32
greedy == transformers loading the same GGUF in fp32, first 32 tokens."""

from __future__ import annotations

import functools

import pytest
import torch

from laneserve import LLM, SamplingParams
from laneserve.model.loader import default_model_path

N = 32
SLOW = pytest.mark.slow
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "What are three facts about the moon?"}]


@functools.cache
def hf_model():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    model.generation_config.eos_token_id = None
    return model.eval()


def hf_generate(ids: list[int]) -> list[int]:
    from transformers import GenerationConfig

    cfg = GenerationConfig(do_sample=False, max_new_tokens=N, eos_token_id=None, pad_token_id=2)
    x = torch.tensor([ids])
    with torch.no_grad():
        out = hf_model().generate(x, attention_mask=torch.ones_like(x), generation_config=cfg)
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def llm() -> LLM:
    engine = LLM(dtype="float32")
    yield engine
    engine.shutdown()


@pytest.mark.slow
def test_default_model_matches_transformers_gguf(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    chat_ids = llm.engine.tokenizer.apply_chat_template(CHAT)
    prompts = [tok.encode(p) for p in PROMPTS] + [chat_ids]
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf_generate(p)


def test_default_model_chat_answers(llm: LLM) -> None:
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=24),
        use_tqdm=False,
    )[0].outputs[0]
    assert "Paris" in out.text and out.finish_reason == "stop"


@pytest.fixture(scope="module")
def spec_reference(llm: LLM) -> tuple[list[dict], list[list[int]]]:
    """Prompts for the speculation cases and their no-speculation greedy outputs (once)."""
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    prompts.append(llm.engine.tokenizer.apply_chat_template(CHAT))
    prompts.append(tok.encode("Repeat after me: one two three four, one two three four,"))
    batch = [{"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    return batch, [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]


@pytest.mark.parametrize(
    ("spec", "async_on"),
    # NOTE: all slow (CI): the tiny-model tests in tests/spec cover each path by
    # default, these add the shipped head on the real model
    [
        pytest.param({"method": "mtp", "num_speculative_tokens": 1}, True, marks=SLOW),
        pytest.param({"method": "mtp", "num_speculative_tokens": 2}, False, marks=SLOW),
        pytest.param(
            {"method": "mtp", "num_speculative_tokens": 2, "ngram_first": True}, True, marks=SLOW
        ),
        pytest.param({"method": "ngram", "num_speculative_tokens": 3}, True, marks=SLOW),
        pytest.param(
            {"method": "mtp", "speculative_token_tree": "[(0,), (1,), (2,)]"}, True, marks=SLOW
        ),
        pytest.param(
            {
                "method": "mtp",
                "speculative_token_tree": "[(0,), (1,), (2,)]",
                "quantization": "int8",
            },
            False,
            marks=SLOW,
        ),
    ],
)
def test_default_model_speculation_is_exact(
    spec_reference: tuple[list[dict], list[list[int]]], spec: dict, async_on: bool
) -> None:
    """The shipped MTP head (and n-gram drafts) leave greedy output unchanged."""
    batch, base = spec_reference
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    spec_llm = LLM(dtype="float32", speculative_config=spec, async_scheduling=async_on)
    try:
        outs = spec_llm.generate(batch, params, use_tqdm=False)
        stats = spec_llm.get_stats()
    finally:
        spec_llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == base
    assert stats["spec_num_drafts"] > 0 and stats["spec_num_accepted"] > 0, stats
