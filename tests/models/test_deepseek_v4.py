"""Greedy output of laneserve == transformers `generate` (eager, fp32, one thread) on a
tiny random DeepSeek V4: prompts longer than the sliding window spanning several
compression windows, single and batched, sync and async, chunk boundaries not aligned
to the compression rates, preemption and resume, and n-gram speculation whose rejected
drafts close compressed windows."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest
import torch

from laneserve import LLM, SamplingParams
from tests.e2e.test_tiny_models import run
from tests.models.tiny_deepseek_v4 import indexer_score_gaps
from tests.tiny_models import _cached_model, hf_greedy

N = 20  # generated tokens per prompt
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(n)] for n in lengths]


@functools.cache
def _reference(d: str, prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = hf_greedy(Path(d), list(prompt), n)
        # the indexer's choice must not rest on ties (else which entries it keeps is
        # luck): the k-th and (k+1)-th scores differ by far more than fp32 noise (~1e-7)
        gaps = indexer_score_gaps(_cached_model(d), list(prompt) + out)
        assert gaps and min(gaps) > 2e-6, "indexer top-k has no score gap on this sequence"
        return tuple(out)
    finally:
        torch.set_num_threads(threads)


def check_against_hf(d: Path, prompts: list[list[int]], got: list[list[int]], n: int = N):
    for p, g in zip(prompts, got, strict=True):
        assert g == list(_reference(str(d), tuple(p), n)), f"prompt of {len(p)} tokens diverged"


# prompt lengths around the window (8) and the rates (4, 8): 1 .. 7 windows of HCA
LENGTHS = [37, 9, 60, 22, 3, 45]


@pytest.mark.parametrize("async_scheduling", [pytest.param(False, marks=pytest.mark.slow), True])
def test_single_and_batched_match_hf(deepseek_v4_model: Path, async_scheduling: bool) -> None:
    d = deepseek_v4_model
    prompts = prompts_of(LENGTHS, seed=0)
    with LLM(str(d), dtype="float32", async_scheduling=async_scheduling) as llm:
        single = run(llm, prompts[:1], GREEDY)
        batched = run(llm, prompts, GREEDY)
    assert batched[0] == single[0]
    check_against_hf(d, prompts, batched)


@pytest.mark.parametrize("chunk", [pytest.param(3, marks=pytest.mark.slow), 7])
def test_chunked_prefill_matches_hf(deepseek_v4_model: Path, chunk: int) -> None:
    d = deepseek_v4_model
    prompts = prompts_of([37, 22, 45], seed=1)
    with LLM(str(d), dtype="float32", max_num_batched_tokens=chunk, max_num_seqs=3) as llm:
        got = run(llm, prompts, GREEDY)
        assert llm.get_stats()["num_prefill_chunks"] > len(prompts)
    check_against_hf(d, prompts, got)


@pytest.mark.parametrize("async_scheduling", [pytest.param(False, marks=pytest.mark.slow), True])
def test_preemption_and_resume_match_hf(deepseek_v4_model: Path, async_scheduling: bool) -> None:
    d = deepseek_v4_model
    prompts = prompts_of([30, 18, 26, 12, 40], seed=2)
    with LLM(
        str(d),
        dtype="float32",
        block_size=4,
        num_kv_blocks=24,
        max_model_len=64,
        async_scheduling=async_scheduling,
    ) as llm:
        got = run(llm, prompts, GREEDY)
        stats = llm.get_stats()
        assert stats["num_preemptions"] > 0
        assert stats["num_free_blocks"] == 24  # every group's blocks came back
    check_against_hf(d, prompts, got)


@pytest.mark.parametrize("async_scheduling", [pytest.param(False, marks=pytest.mark.slow), True])
@pytest.mark.parametrize("k", [1, 3])
def test_ngram_speculation_matches_hf(
    deepseek_v4_model: Path, async_scheduling: bool, k: int
) -> None:
    """Drafts are verified and many rejected; a rejected draft that closed a compressed
    window leaves an entry that the true token at that position recomputes."""
    d = deepseek_v4_model
    rng = random.Random(3)
    motifs = [[rng.randrange(3, 320) for _ in range(5)] for _ in range(3)]
    prompts = [m * 6 + m[:2] for m in motifs]  # repetitive: the n-gram lookup proposes
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1}
    with LLM(
        str(d), dtype="float32", speculative_config=spec, async_scheduling=async_scheduling
    ) as llm:
        got = run(llm, prompts, GREEDY)
        stats = llm.get_stats()
    assert stats["spec_num_drafts"] > 0
    assert stats["spec_num_accepted"] < stats["spec_num_drafts"]  # rollbacks happened
    check_against_hf(d, prompts, got)


def test_release_layout_loads_the_same_model(deepseek_v4_model: Path, tmp_path: Path) -> None:
    from tests.models.tiny_deepseek_v4 import to_release_layout

    release = to_release_layout(deepseek_v4_model, tmp_path / "release")
    prompts = prompts_of([37, 12], seed=4)
    with LLM(str(release), dtype="float32") as llm:
        got = run(llm, prompts, GREEDY)
    check_against_hf(deepseek_v4_model, prompts, got)


def test_fp8_and_fp4_release_weights_dequantize_at_load(
    deepseek_v4_model: Path, tmp_path: Path
) -> None:
    """FP8 matrices with ue8m0 `.scale` blocks and FP4-packed experts: laneserve's greedy
    output equals transformers running the same (dequantized) values."""
    from safetensors.torch import load_file

    from tests.models.tiny_deepseek_v4 import quantized_release

    quant, reference = quantized_release(deepseek_v4_model, tmp_path / "q", tmp_path / "ref")
    stored = load_file(str(quant / "model.safetensors"))
    assert stored["layers.1.attn.wq_b.weight"].dtype == torch.float8_e4m3fn
    assert stored["layers.1.ffn.experts.3.w2.weight"].dtype == torch.int8  # FP4 pairs
    assert stored["layers.1.ffn.experts.3.w2.scale"].dtype == torch.float8_e8m0fnu
    prompts = prompts_of([37, 12], seed=5)
    with LLM(str(quant), dtype="float32") as llm:
        got = run(llm, prompts, GREEDY)
    check_against_hf(reference, prompts, got)


def test_bfloat16_run_generates(deepseek_v4_model: Path) -> None:
    """bf16 weights and cache with fp32 activations (the CPU default): every cache write
    and raw-weight product casts to the right dtype, so requests finish (no failed step)."""
    prompts = prompts_of([37, 9], seed=6)
    with LLM(str(deepseek_v4_model), dtype="bfloat16") as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for o in outs:
        assert o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == N
    # the values: each prompt token's logprob against transformers' on the bf16-rounded
    # weights (fp32 math). Under bf16 rounding this random model's decisive routing and
    # indexer choices flip at some positions (nats apart there), so the bound is on the
    # median: a wrong cast or cache write moves every position.
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    with LLM(str(deepseek_v4_model), dtype="bfloat16") as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    model = _bf16_rounded(str(deepseek_v4_model))
    diffs = []
    for p, o in zip(prompts, outs, strict=True):
        assert o.prompt_logprobs is not None
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1)
        for pos in range(1, len(p)):
            got = o.prompt_logprobs[pos][p[pos]].logprob
            diffs.append(abs(got - ref[pos - 1, p[pos]].item()))
    assert sorted(diffs)[len(diffs) // 2] < 0.5, sorted(diffs)


@functools.cache
def _bf16_rounded(d: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        for w in model.parameters():
            w.copy_(w.bfloat16().float())
    return model


def test_blocked_prefill_attention_matches_hf(
    deepseek_v4_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompt rows attend in blocks of consecutive queries (one gather of the window per
    block): blocks of 5 queries, not aligned to the window (8) or the rates (4, 8),
    chunked prefill beside decode rows in the same steps; tokens equal transformers."""
    from laneserve.model.deepseek_v4 import attention

    seen: list[list[bool]] = []  # per attention call: block (True) / per-token segments

    def segments(num_tokens: int, spans: tuple) -> list:
        out = list(segments_of(num_tokens, spans))
        seen.append([first is not None for _, _, first in out])
        return out

    segments_of = attention._segments
    monkeypatch.setattr(attention, "PREFILL_QUERY_BLOCK", 5)
    monkeypatch.setattr(attention, "_segments", segments)
    d = deepseek_v4_model
    prompts = prompts_of([37, 22, 45], seed=7)
    with LLM(
        str(d), dtype="float32", worker_mode="thread", max_num_batched_tokens=13, max_num_seqs=3
    ) as llm:
        got = run(llm, prompts, GREEDY)
    check_against_hf(d, prompts, got)
    assert any(sum(kinds) > 1 for kinds in seen)  # a row cut into several blocks
    assert any(True in kinds and False in kinds for kinds in seen)  # blocks beside decode rows


def test_only_closing_prompt_tokens_compute_entries() -> None:
    from laneserve.model.deepseek_v4.compressor import closing_rows

    assert closing_rows(10, (), 4) is None  # no prompt rows: every token computes
    # tokens 0, 1 decode; tokens 2..10 a prompt row at positions 5..13; token 11 decode
    assert closing_rows(12, ((2, 9, 5),), 4) == [0, 1, 4, 8, 11]
    assert closing_rows(3, ((0, 3, 0),), 4) == []  # no window closes
    assert closing_rows(8, ((0, 8, 0),), 8) == [7]
