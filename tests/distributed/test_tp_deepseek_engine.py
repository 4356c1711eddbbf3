"""`LLM(DeepSeek V2 / V3, tensor_parallel_size=2)`: the worker process is rank 0 of two
gloo ranks on 127.0.0.1; greedy tokens equal one device's for a batch of prompts of
different lengths, also with V3's and V3.2's MTP layers drafting (k = 2, async) and with
n-gram drafts (family-independent: also on Llama)."""

from __future__ import annotations

from pathlib import Path

import pytest

from laneserve import LLM, SamplingParams
from tests.distributed.tp_engine import (
    assert_two_ranks_generate_what_one_device_does,
    two_ranks,
)
from tests.e2e.test_tiny_models import mixed_prompts, run
from tests.models.tiny_deepseek_v32 import build_copying_mtp, build_tiny_deepseek_v32
from tests.tiny_models import build_exact_deepseek_mtp, hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.slow
@pytest.mark.parametrize(("version", "async_scheduling"), [("v3", True), ("v2", False)])
def test_two_ranks_generate_what_one_device_does(
    tp_deepseek: dict[str, Path], version: str, async_scheduling: bool
) -> None:
    prompts = mixed_prompts(6, seed=2)  # different lengths, one batch
    assert_two_ranks_generate_what_one_device_does(
        str(tp_deepseek[version]), prompts, (async_scheduling,)
    )


@pytest.mark.slow
def test_two_ranks_with_the_mtp_layer_drafting(tmp_path: Path) -> None:
    # a V3 whose MTP layer copies its (MoE) decoder layer, attention kept: it drafts the
    # target's next token most of the time, so accepted drafts prove the head engaged
    d = build_exact_deepseek_mtp(tmp_path / "mtp", keep_attention=True)
    prompts = mixed_prompts(4, seed=12, lo=3, hi=40)
    got = two_ranks_draft_as_one_device(d, prompts)
    assert got[0] == hf_greedy(d, prompts[0], 24)


def two_ranks_draft_as_one_device(d: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of two ranks drafting with MTP k = 2 (async), asserted equal to one
    device's without speculation, with drafts proposed and accepted."""
    with LLM(str(d), dtype="float32") as llm:
        want = run(llm, prompts, GREEDY)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    with two_ranks(str(d), async_scheduling=True, speculative_config=spec) as llm:
        got = run(llm, prompts, GREEDY)
        stats = llm.get_stats()
    assert got == want
    assert stats["spec_num_drafts"] > 0 and stats["spec_num_accepted"] > 0, stats
    return got


@pytest.mark.slow
@pytest.mark.parametrize("model", ["deepseek_v2", "llama"])
def test_two_ranks_with_ngram_drafts(
    tp_deepseek: dict[str, Path], tiny_models: dict[str, Path], model: str
) -> None:
    d = str(tp_deepseek["v2"] if model == "deepseek_v2" else tiny_models["llama"])
    prompts = [p * 3 for p in mixed_prompts(3, seed=13, lo=4, hi=8)]  # repeats: lookups hit
    with LLM(d, dtype="float32") as llm:
        want = run(llm, prompts, GREEDY)
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with two_ranks(d, async_scheduling=True, speculative_config=spec) as llm:
        got = run(llm, prompts, GREEDY)
        stats = llm.get_stats()
    assert got == want
    assert stats["spec_num_drafts"] > 0, stats


@pytest.mark.slow
def test_an_uneven_head_count_is_refused_at_start(tmp_path: Path) -> None:
    from tests.tiny_models import build_tiny_deepseek

    d = build_tiny_deepseek(tmp_path / "odd", 3, num_attention_heads=3, num_key_value_heads=3)
    with pytest.raises(ValueError, match=r"does not divide the model's attention heads \(3\)"):
        two_ranks(str(d))


@pytest.mark.slow
def test_v32_two_ranks_generate_what_one_device_does(tmp_path: Path) -> None:
    """V3.2: MLA's heads split, the indexer whole on each rank (`index_topk` 6, so the
    selection drops tokens of these prompts)."""
    d = build_tiny_deepseek_v32(tmp_path / "v32", seed=3, index_topk=6)
    prompts = mixed_prompts(4, seed=21, lo=8, hi=40)
    assert_two_ranks_generate_what_one_device_does(str(d), prompts, (True,))


@pytest.mark.slow
def test_v32_two_ranks_with_the_mtp_layer_drafting(tmp_path: Path) -> None:
    """V3.2's MTP layer (its own indexer whole on each rank, MLA's heads split) copying
    the target's one layer: accepted drafts, one device's tokens."""
    src = build_tiny_deepseek_v32(tmp_path / "v32", seed=3, index_topk=6)
    d = build_copying_mtp(src, tmp_path / "copy")
    two_ranks_draft_as_one_device(d, mixed_prompts(4, seed=12, lo=8, hi=40))
