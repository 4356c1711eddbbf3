"""The checkpoint's own MTP layer as the draft source of DeepSeek V3: its drafts equal
transformers' generic MTP layer, speculative greedy equals plain greedy, and an MTP
layer that predicts exactly is accepted 100 %."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from laneserve import LLM, SamplingParams
from laneserve.kernels import get_kernels
from laneserve.model.deepseek.model import DeepseekModel
from laneserve.model.deepseek.mtp import load_deepseek_mtp
from laneserve.model.layers.attention import AttentionMetadata, PrefillSpan
from laneserve.model.loader import resolve_checkpoint
from laneserve.model.registry import open_weights
from tests.e2e.test_tiny_models import mixed_prompts, run
from tests.tiny_models import (
    _cached_model,
    add_mtp_layer,
    build_exact_deepseek_mtp,
    build_tiny_deepseek,
    hf_greedy,
    hf_mtp_layer,
)

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def with_mtp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = build_tiny_deepseek(tmp_path_factory.mktemp("ds") / "v3", 3, seed=3)
    return add_mtp_layer(d, seed=4)


def prefill_meta(n: int) -> AttentionMetadata:
    """Metadata of one n-token prompt chunk from position 0 (16-token blocks 0, 1, ...)."""
    return AttentionMetadata(
        slot_mapping=torch.arange(n),
        num_decode_tokens=0,
        decode_block_tables=None,
        decode_seq_lens=None,
        decode_query_start_loc=None,
        prefills=(PrefillSpan(0, n, 0, torch.arange(-(-n // 16))),),
    )


def test_draft_equals_transformers_mtp_layer(with_mtp: Path) -> None:
    cpu = torch.device("cpu")
    ckpt = resolve_checkpoint(str(with_mtp), "float32", cpu)
    kernels = get_kernels(cpu)
    store = open_weights(ckpt, cpu, torch.float32)
    base = DeepseekModel(ckpt.arch, kernels, store, cpu, torch.float32, 512)
    head = load_deepseek_mtp(store, base, kernels, None, None)
    ids = torch.tensor(mixed_prompts(1, seed=9, lo=40, hi=40)[0])
    n, latent = ids.shape[0], ckpt.arch.deepseek.latent_dim
    caches = [(torch.zeros(4, 16, 1, latent),) for _ in range(4)]
    hidden, _ = base.forward(ids, torch.arange(n), prefill_meta(n), caches[:3])
    out = head.forward(ids[1:], hidden[:-1], torch.arange(n - 1), prefill_meta(n - 1), caches[3])
    got = head.head(out)  # [n - 1, V]
    hf = _cached_model(str(with_mtp))
    layer = hf_mtp_layer(with_mtp)
    torch.set_num_threads(1)
    with torch.no_grad():
        h = hf.model(ids[None]).last_hidden_state  # final-normed
        emb = hf.model.embed_tokens(ids[None, 1:])
        pos = torch.arange(n - 1)[None]
        rope = hf.model.rotary_emb(emb, pos)
        mask = torch.full((n - 1, n - 1), float("-inf")).triu(1)[None, None]
        ref = hf.lm_head(layer(emb, h[:, :-1], rope, mask, pos, None))[0]
    assert torch.allclose(hidden, h[0], atol=1e-4)
    assert torch.allclose(got, ref, atol=2e-3, rtol=1e-3), (got - ref).abs().max()
    assert torch.equal(head.draft(out)[:, 0], ref.argmax(-1))


def _spec(k: int) -> dict:
    return {"speculative_config": {"method": "mtp", "num_speculative_tokens": k}}


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_speculative_greedy_equals_plain(with_mtp: Path, k: int, async_scheduling: bool) -> None:
    prompts = mixed_prompts(4, seed=11)
    with LLM(str(with_mtp), dtype="float32", async_scheduling=async_scheduling, **_spec(k)) as llm:
        got = run(llm, prompts)
        stats = llm.get_stats()
    assert stats["spec_num_drafts"] > 0
    for p, g in zip(prompts, got, strict=True):
        assert g == hf_greedy(with_mtp, p, 24)


@pytest.mark.parametrize(("async_scheduling", "inert_layers"), [(False, 0), (True, 0), (True, 2)])
def test_exact_mtp_layer_accepted_fully(
    tmp_path: Path, async_scheduling: bool, inert_layers: int
) -> None:
    d = build_exact_deepseek_mtp(tmp_path / "exact", inert_layers=inert_layers)
    prompts = mixed_prompts(3, seed=12, lo=3, hi=20)
    with LLM(str(d), dtype="float32", async_scheduling=async_scheduling, **_spec(2)) as llm:
        got = run(llm, prompts)
        stats = llm.get_stats()
    assert stats["spec_num_drafts"] > 0
    assert stats["spec_num_accepted"] == stats["spec_num_drafts"]
    for p, g in zip(prompts, got, strict=True):
        assert g == hf_greedy(d, p, 24)


def test_checkpoint_without_mtp_layer_is_refused(deepseek_models: dict[str, Path]) -> None:
    d = deepseek_models["v3"]  # num_nextn_predict_layers = 1, but no layer stored
    assert json.loads((d / "config.json").read_text())["num_nextn_predict_layers"] == 1
    with pytest.raises(Exception, match="carries no MTP layer"):
        LLM(str(d), dtype="float32", **_spec(1))


def assert_head_options_refused(model: Path, tree_refusal: str | None = None) -> None:
    """The MTP options a DeepSeek checkpoint refuses (its own layer drafts, as stored)
    are refused with their messages; the draft file exists, so only the family refuses
    it. `tree_refusal`: token trees are refused too, with this message."""
    weights = str(next(model.glob("*.safetensors")))
    refused = [
        ({"draft_weights": weights}, "separate draft_weights are not supported"),
        ({"quantization": "int8"}, "MTP quantization is not supported"),
    ]
    for option, needle in refused:
        cfg = {"method": "mtp", "num_speculative_tokens": 1, **option}
        with pytest.raises(Exception, match=needle):
            LLM(str(model), dtype="float32", speculative_config=cfg)
    if tree_refusal is not None:
        tree = {"method": "mtp", "speculative_token_tree": "[(0,), (1,), (2,)]"}
        with pytest.raises(ValueError, match=tree_refusal):
            LLM(str(model), dtype="float32", speculative_config=tree)


def test_separate_or_quantized_head_is_refused(with_mtp: Path) -> None:
    assert_head_options_refused(with_mtp)


def test_mtp_with_ngram_first_equals_plain(with_mtp: Path) -> None:
    prompts = [p * 3 for p in mixed_prompts(2, seed=13, lo=4, hi=8)]  # repeats: lookups hit
    cfg = {"method": "mtp", "num_speculative_tokens": 2, "ngram_first": True}
    with LLM(str(with_mtp), dtype="float32", speculative_config=cfg) as llm:
        got = run(llm, prompts)
        assert llm.get_stats()["spec_num_drafts"] > 0
    for p, g in zip(prompts, got, strict=True):
        assert g == hf_greedy(with_mtp, p, 24)
