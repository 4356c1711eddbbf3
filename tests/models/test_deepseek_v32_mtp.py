"""DeepSeek V3.2's own MTP layer as the draft source: its block is a V3.2 decoder layer
whose sparse attention selects through an indexer of its own, over cache groups of its
own (`mtp`, `mtp_indexer`).

Its logits equal the independent reference's MTP layer (`dsv32_reference.py`) over a
prompt chunk and a decode step, where the top-k selection drops keys; speculative greedy
(k = 1 and 2, async scheduling, concurrent requests with prompts longer than
`index_topk`) equals plain greedy token for token, with drafts proposed and, from an MTP
layer that copies the target's, mostly accepted (also over chunked prompts, prefix-cache
hits and preemption, and with bf16 weights); the MTP layer's own indexer cuts its
queries' keys; a separate or quantized draft head and token trees are refused (a
checkpoint without the layer: `test_deepseek_v32.py`)."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from laneserve import LLM, SamplingParams
from laneserve.kernels import get_kernels
from laneserve.model.arch import ArchConfig
from laneserve.model.deepseek_v32 import indexer
from laneserve.model.deepseek_v32.model import DeepseekV32Model
from laneserve.model.deepseek_v32.mtp import DeepseekV32MtpHead, load_deepseek_v32_mtp
from laneserve.model.layers.attention import AttentionMetadata
from laneserve.model.loader import resolve_checkpoint
from laneserve.model.registry import family_for, open_weights
from tests.e2e.test_tiny_models import mixed_prompts, run
from tests.models.dsv32_reference import ReferenceV32
from tests.models.test_deepseek_mtp import assert_head_options_refused, prefill_meta
from tests.models.tiny_deepseek_v32 import (
    INDEX_DIM,
    KV_LORA,
    ROPE,
    add_mtp_layer,
    build_copying_mtp,
    build_tiny_deepseek_v32,
    release_config,
)

N = 16
TOPK = 6  # the tiny release config's index_topk: every prompt below is longer


@pytest.fixture(scope="module")
def v32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny V3.2 checkpoint without an MTP layer."""
    return build_tiny_deepseek_v32(tmp_path_factory.mktemp("v32") / "v32", seed=3)


@pytest.fixture(scope="module")
def with_mtp(v32: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same with a random MTP layer under the release's names."""
    d = tmp_path_factory.mktemp("v32_mtp") / "v32"
    d.mkdir()
    for f in v32.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    return add_mtp_layer(d, seed=4)


@pytest.fixture(scope="module")
def copying(v32: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_copying_mtp(v32, tmp_path_factory.mktemp("v32_copy") / "copy")


@pytest.fixture
def mtp_cuts(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """MTP forwards, and the queries inside them whose keys the indexer cut to top k."""
    seen = {"forwards": 0, "queries_cut": 0}
    inside = [False]
    forward, select = DeepseekV32MtpHead.forward, indexer.Indexer.select

    def counted_forward(self, *args):  # type: ignore[no-untyped-def]
        seen["forwards"] += 1
        inside[0] = True
        try:
            return forward(self, *args)
        finally:
            inside[0] = False

    def counted_select(self, q, weights, keys, limit):  # type: ignore[no-untyped-def]
        if inside[0]:
            seen["queries_cut"] += int((limit >= self.topk).sum())
        return select(self, q, weights, keys, limit)

    monkeypatch.setattr(DeepseekV32MtpHead, "forward", counted_forward)
    monkeypatch.setattr(indexer.Indexer, "select", counted_select)
    yield seen


def _spec(k: int) -> dict:
    return {"speculative_config": {"method": "mtp", "num_speculative_tokens": k}}


def _greedy(n: int = N) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@functools.cache
def _plain(d: Path, prompts: tuple[tuple[int, ...], ...]) -> list[list[int]]:
    with LLM(str(d), dtype="float32") as llm:
        return run(llm, [list(p) for p in prompts], _greedy())


def _prompts(seed: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(p) for p in mixed_prompts(4, seed=seed, lo=TOPK + 4, hi=40))


def test_cache_groups_add_the_mtp_layers_latents_and_indexer_keys() -> None:
    arch = ArchConfig.from_hf(release_config(num_nextn_predict_layers=1))
    groups = family_for(arch).cache_groups(arch, 16, 4, 1)
    assert [g.name for g in groups] == ["main", "indexer", "mtp", "mtp_indexer"]
    assert [g.num_layers for g in groups] == [3, 3, 1, 1]
    assert [g.entry_shape for g in groups] == [(1, KV_LORA + ROPE), (1, INDEX_DIM)] * 2
    assert {g.kind for g in groups} == {"full_attention"} and {g.block_size for g in groups} == {16}
    assert [g.name for g in family_for(arch).cache_groups(arch, 16, 4, 0)] == ["main", "indexer"]


def _decode(pos: int, blocks: int) -> AttentionMetadata:
    """One decode row at `pos` over blocks 0 .. blocks - 1."""
    return AttentionMetadata(
        slot_mapping=torch.tensor([pos]),
        num_decode_tokens=1,
        decode_block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        decode_seq_lens=torch.tensor([pos + 1], dtype=torch.int32),
        decode_query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        prefills=(),
    )


def test_mtp_logits_equal_the_reference(with_mtp: Path, mtp_cuts: dict[str, int]) -> None:
    """A prompt chunk over positions 0 .. n - 3, then a decode step at n - 2 (both past
    index_topk: sparse), against the reference's MTP layer over the whole prompt."""
    cpu = torch.device("cpu")
    ckpt = resolve_checkpoint(str(with_mtp), "float32", cpu)
    kernels, store = get_kernels(cpu), open_weights(ckpt, cpu, torch.float32)
    base = DeepseekV32Model(ckpt.arch, kernels, store, cpu, torch.float32, 512)
    head = load_deepseek_v32_mtp(store, base, kernels, None, None)
    assert isinstance(head, DeepseekV32MtpHead)
    ids = torch.tensor(mixed_prompts(1, seed=9, lo=30, hi=30)[0])
    n, latent, blocks = ids.shape[0], ckpt.arch.deepseek.latent_dim, 2
    latents = [(torch.zeros(blocks, 16, 1, latent),) for _ in range(4)]
    keys = [(torch.zeros(blocks, 16, 1, INDEX_DIM),) for _ in range(4)]
    meta = prefill_meta(n)
    hidden, _ = base.forward(ids, torch.arange(n), (meta, meta), [latents[:3], keys[:3]])
    cache = (latents[3], keys[3])
    chunk = prefill_meta(n - 2)
    out = head.forward(ids[1:-1], hidden[:-2], torch.arange(n - 2), (chunk, chunk), cache)
    step = _decode(n - 2, blocks)
    last = head.forward(ids[-1:], hidden[-2:-1], torch.tensor([n - 2]), (step, step), cache)
    got = head.head(torch.cat([out, last]))  # [n - 1, V]
    torch.set_num_threads(1)
    ref = ReferenceV32.load(with_mtp).mtp_logits(ids.tolist())
    assert torch.allclose(got, ref, atol=2e-3, rtol=1e-3), (got - ref).abs().max()
    assert torch.equal(head.draft(torch.cat([out, last]))[:, 0], ref.argmax(-1))
    assert mtp_cuts["queries_cut"] >= n - 1 - TOPK, "the MTP indexer dropped no key"


@pytest.mark.parametrize(
    ("k", "async_scheduling", "ngram_first"),
    [(1, True, False), (2, True, False), (2, False, False), (2, True, True)],
)
def test_speculative_greedy_equals_plain(
    with_mtp: Path, k: int, async_scheduling: bool, ngram_first: bool, mtp_cuts: dict[str, int]
) -> None:
    """Four concurrent requests (async scheduling, the default, and sync; with prompt
    lookups first): the random MTP layer's drafts are proposed and verified; the tokens
    are plain greedy's."""
    prompts = _prompts(seed=11)
    spec = {"method": "mtp", "num_speculative_tokens": k, "ngram_first": ngram_first}
    kw = {"dtype": "float32", "async_scheduling": async_scheduling}
    with LLM(str(with_mtp), speculative_config=spec, **kw) as llm:
        got = run(llm, [list(p) for p in prompts], _greedy())
        stats = llm.get_stats()
    assert stats["spec_num_drafts"] > 0
    assert mtp_cuts["forwards"] > 0 and mtp_cuts["queries_cut"] > 0
    assert got == _plain(with_mtp, prompts)


@pytest.mark.parametrize("k", [1, 2])
def test_copying_mtp_layer_is_mostly_accepted(copying: Path, k: int) -> None:
    """An MTP layer that copies the target's one layer drafts its next token most of the
    time (not always: it sees one token less): accepted drafts and plain greedy's tokens."""
    prompts = _prompts(seed=12)
    with LLM(str(copying), dtype="float32", **_spec(k)) as llm:
        got = run(llm, [list(p) for p in prompts], _greedy())
        stats = llm.get_stats()
    drafts, accepted = stats["spec_num_drafts"], stats["spec_num_accepted"]
    assert drafts > 0 and accepted > drafts // 2, (accepted, drafts)
    assert got == _plain(copying, prompts)


def test_separate_or_quantized_head_and_token_trees_are_refused(with_mtp: Path) -> None:
    """The checkpoint without the layer: `test_deepseek_v32.py`."""
    assert_head_options_refused(with_mtp, "DeepseekV32ForCausalLM does not support token trees")


def test_chunked_prefill_prefix_hits_and_preemption_keep_the_drafts(copying: Path) -> None:
    """Prompt chunks of 8 over blocks of 4 (the MTP layer's sparse prompt rows select
    through its groups' tables, context included), a second pass from the prefix cache
    (all four groups' blocks), and a pool small enough to preempt: plain greedy's tokens,
    and the copying layer's drafts still mostly accepted (its caches hold the right
    entries)."""
    prompts = _prompts(seed=13)
    kw: dict = {"dtype": "float32", "block_size": 4, "max_num_batched_tokens": 8}
    with LLM(str(copying), **kw) as llm:
        want = run(llm, [list(p) for p in prompts], _greedy())
    with LLM(str(copying), **kw, **_spec(2)) as llm:
        cold = run(llm, [list(p) for p in prompts], _greedy())
        assert run(llm, [list(p) for p in prompts], _greedy()) == cold
        stats = llm.get_stats()
    assert stats["num_prefill_chunks"] > len(prompts) and stats["prefix_cache_hits"] > 0
    assert stats["spec_num_accepted"] > stats["spec_num_drafts"] // 2, stats
    assert cold == want
    small = {"block_size": 4, "num_kv_blocks": 30, "max_model_len": 64}
    with LLM(str(copying), dtype="float32", enable_prefix_caching=False, **small) as llm:
        want = run(llm, [list(p) for p in prompts], _greedy(24))
    with LLM(str(copying), dtype="float32", **small, **_spec(2)) as llm:
        got = run(llm, [list(p) for p in prompts], _greedy(24))
        stats = llm.get_stats()
    assert stats["num_preemptions"] > 0 and stats["num_free_blocks"] == 30
    assert stats["spec_num_accepted"] > stats["spec_num_drafts"] // 2, stats
    assert got == want


def test_bfloat16_weights_speculative_greedy_equals_plain(copying: Path) -> None:
    """bf16 weights (the release's dtype): verified drafts give the plain bf16 tokens."""
    prompts = [list(p) for p in _prompts(seed=14)]
    with LLM(str(copying), dtype="bfloat16") as llm:
        want = run(llm, prompts, _greedy())
    with LLM(str(copying), dtype="bfloat16", **_spec(2)) as llm:
        got = run(llm, prompts, _greedy())
        stats = llm.get_stats()
    assert stats["spec_num_accepted"] > stats["spec_num_drafts"] // 2, stats
    assert got == want
