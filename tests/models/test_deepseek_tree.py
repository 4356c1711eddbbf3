"""MTP token trees on DeepSeek V3: the alternatives to the first draft run as side rows
through MLA (their latent entry in a scratch slot, attending to the request's committed
latents), and an accepted alternative's latent is committed into the request's slot.
Speculative greedy with a tree equals transformers' greedy, on the kernels' paged
attention and on the torch path, sync and async; counters show the side rows ran and
alternatives were accepted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from laneserve import LLM, SamplingParams
from laneserve.kernels import load_kernels
from laneserve.model.layers import mla
from laneserve.model.layers.attention import AttentionMetadata
from laneserve.worker import side_rows
from tests.e2e.test_tiny_models import mixed_prompts, run
from tests.tiny_models import (
    add_mtp_layer,
    build_exact_deepseek_mtp,
    build_tiny_deepseek,
    hf_greedy,
)

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
TREE = "[(0,), (1,), (2,)]"


@pytest.fixture(scope="module")
def near_exact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-layer V3 with real attention whose MTP layer copies its layer: right most of
    the time, and where it is not, its runners-up often are (alternatives accepted)."""
    return build_exact_deepseek_mtp(tmp_path_factory.mktemp("ds") / "near", keep_attention=True)


@pytest.fixture(scope="module")
def random_mtp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = build_tiny_deepseek(tmp_path_factory.mktemp("ds") / "v3", 3, seed=3)
    return add_mtp_layer(d, seed=4)


@pytest.fixture
def counters(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Side rows through MLA decodes, and alternatives accepted (committed)."""
    seen = {"side_decodes": 0, "accepted_alternatives": 0}
    decode, commit = mla.MlaAttention._decode, side_rows.commit

    def counted_decode(self: mla.MlaAttention, q_nope, q_pe, store, meta: AttentionMetadata):
        seen["side_decodes"] += meta.decode_last_slot is not None
        return decode(self, q_nope, q_pe, store, meta)

    def counted_commit(kernels, stack, side, hit, *rest) -> None:
        seen["accepted_alternatives"] += int(hit.sum())
        commit(kernels, stack, side, hit, *rest)

    monkeypatch.setattr(mla.MlaAttention, "_decode", counted_decode)
    monkeypatch.setattr(side_rows, "commit", counted_commit)
    return seen


def _tree(shape: str) -> dict:
    return {"speculative_config": {"method": "mtp", "speculative_token_tree": shape}}


def _check(d: Path, prompts: list[list[int]], got: list[list[int]], n: int) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the reference runs beside laneserve's threads
    try:
        for p, g in zip(prompts, got, strict=True):
            assert g == hf_greedy(d, p, n), f"prompt of {len(p)} tokens diverged"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("use_kernels", [True, False], ids=["paged-kernel", "torch"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_tree_greedy_equals_plain_and_alternatives_accepted(
    near_exact: Path, counters: dict[str, int], use_kernels: bool, async_scheduling: bool
) -> None:
    if use_kernels and load_kernels() is None:
        pytest.skip("the CPU kernels do not build here")
    prompts = mixed_prompts(6, seed=21)
    with LLM(
        str(near_exact),
        dtype="float32",
        async_scheduling=async_scheduling,
        use_kernels=use_kernels,
        **_tree(TREE),
    ) as llm:
        got = run(llm, prompts, GREEDY)
        stats = llm.get_stats()
    assert stats["spec_num_drafts"] > 0
    assert counters["side_decodes"] > 0, "no side row went through MLA"
    assert counters["accepted_alternatives"] > 0, "no alternative was accepted"
    _check(near_exact, prompts, got, 32)


def test_tree_with_a_chain_under_the_first_draft(near_exact: Path, counters: dict) -> None:
    prompts = mixed_prompts(4, seed=22)
    with LLM(str(near_exact), dtype="float32", **_tree("[(0,), (1,), (0, 0)]")) as llm:
        got = run(llm, prompts, GREEDY)
        stats = llm.get_stats()
    assert len(stats["spec_acceptance_per_position"]) == 2
    assert stats["spec_num_accepted"] > 0 and counters["accepted_alternatives"] > 0
    _check(near_exact, prompts, got, 32)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_tree_on_moe_layers_under_preemption(
    random_mtp: Path, counters: dict[str, int], async_scheduling: bool
) -> None:
    """Three layers (dense + MoE, MoE in the MTP layer), small blocks, preemption and
    prefix caching: a tree still changes nothing."""
    prompts = mixed_prompts(5, seed=23, lo=10, hi=30)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    with LLM(
        str(random_mtp),
        dtype="float32",
        block_size=4,
        num_kv_blocks=40,
        max_model_len=64,
        async_scheduling=async_scheduling,
        **_tree("[(0,), (1,), (2,), (0, 0)]"),
    ) as llm:
        got = run(llm, prompts, params)
        stats = llm.get_stats()
    assert stats["num_preemptions"] > 0 and stats["spec_num_drafts"] > 0
    assert counters["side_decodes"] > 0
    _check(random_mtp, prompts, got, 30)
