"""DeepSeek V3.2 (DeepSeek Sparse Attention): greedy output equals, token for token, an
independent fp32 reference written from DeepSeek's own V3.2 inference code
(`dsv32_reference.py`) and transformers' `deepseek_v32` (fp32), on a tiny random
checkpoint with the release's tensor names and config keys, whose `index_topk` (6) is
far below the prompts' lengths, so the indexer's selection decides what every later
query attends to: single requests, mixed-length batches (equal to one at a time), sync
and async, chunked prefill over small blocks, prefix-cache hits, preemption, and the release
layout itself (FP8 weights with block scales, bf16 elsewhere, sharded, with its MTP
layer). Counters show the sparse paths ran and dropped keys; with `index_topk` above
every context the model is V3; bad configs are refused by name."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch

from laneserve import LLM, SamplingParams
from laneserve.model.arch import ArchConfig, UnsupportedModelError
from laneserve.model.deepseek_v32 import attention, indexer
from tests.e2e.test_tiny_models import mixed_prompts, run
from tests.models.dsv32_reference import ReferenceV32
from tests.models.tiny_deepseek_v32 import (
    build_tiny_deepseek_v32,
    release_config,
    write_release_layout,
)
from tests.tiny_models import hf_greedy

N = 16


@pytest.fixture(scope="module")
def v32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_deepseek_v32(tmp_path_factory.mktemp("v32") / "v32", seed=3)


@pytest.fixture
def counters(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Sparse prompt chunks, sparse decode steps, and queries that saw more than
    index_topk keys (the selection dropped some)."""
    seen = {"sparse_prefills": 0, "sparse_decodes": 0, "queries_cut": 0}
    select, prefill = indexer.Indexer.select, attention.SparseMlaAttention._sparse_prefill
    rows = attention._DecodeRows.__init__

    def counted_select(self: indexer.Indexer, q, weights, keys, limit):
        seen["queries_cut"] += int((limit >= self.topk).sum())
        return select(self, q, weights, keys, limit)

    def counted_prefill(self: attention.SparseMlaAttention, *args):
        seen["sparse_prefills"] += 1
        return prefill(self, *args)

    def counted_rows(self: attention._DecodeRows, *args) -> None:
        seen["sparse_decodes"] += 1
        rows(self, *args)

    monkeypatch.setattr(indexer.Indexer, "select", counted_select)
    monkeypatch.setattr(attention.SparseMlaAttention, "_sparse_prefill", counted_prefill)
    monkeypatch.setattr(attention._DecodeRows, "__init__", counted_rows)
    return seen


@functools.cache
def _reference(d: Path) -> ReferenceV32:
    return ReferenceV32.load(d)


def check_against_reference(
    d: Path, prompts: list[list[int]], got: list[list[int]], n: int, *, hf: bool = True
) -> None:
    """DeepSeek's algorithm (the independent reference) and, where it loads the
    checkpoint, transformers: both must give laneserve's tokens."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the references run beside laneserve's threads
    try:
        ref = _reference(d)
        before = ref.cut_queries
        for p, g in zip(prompts, got, strict=True):
            assert g == ref.greedy(p, n), f"prompt of {len(p)} tokens diverged (reference)"
            if hf:
                assert g == hf_greedy(d, p, n), f"prompt of {len(p)} tokens diverged (hf)"
        assert ref.cut_queries > before, "the reference's top-k selection dropped nothing"
    finally:
        torch.set_num_threads(threads)


def _greedy(n: int = N, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_single_and_batched_match_the_reference(
    v32: Path, counters: dict[str, int], async_scheduling: bool
) -> None:
    batch = mixed_prompts(5, seed=1, lo=3, hi=40)
    with LLM(str(v32), dtype="float32", async_scheduling=async_scheduling) as llm:
        got_batch = run(llm, batch, _greedy())
        alone = [run(llm, [p], _greedy())[0] for p in batch]
    assert got_batch == alone, "a batch of mixed lengths differs from one at a time"
    assert counters["sparse_prefills"] > 0 and counters["sparse_decodes"] > 0
    assert counters["queries_cut"] > 0, "no query had its keys cut to index_topk"
    check_against_reference(v32, batch, got_batch, N)


@pytest.mark.slow
def test_chunked_prefill_small_blocks_and_prefix_hits_match_the_reference(
    v32: Path, counters: dict[str, int]
) -> None:
    """Chunks of 5 over blocks of 4: prompt chunks with context select through both
    groups' tables; a second run is served from the prefix cache (both groups')."""
    shared = mixed_prompts(1, seed=3, lo=17, hi=17)[0]
    prompts = [shared + tail for tail in mixed_prompts(3, seed=4, lo=2, hi=9)]
    with LLM(
        str(v32), dtype="float32", block_size=4, max_num_batched_tokens=5, max_num_seqs=3
    ) as llm:
        cold = run(llm, prompts, _greedy())
        assert run(llm, prompts, _greedy()) == cold
        stats = llm.get_stats()
    assert stats["num_prefill_chunks"] > len(prompts) and stats["prefix_cache_hits"] > 0
    assert counters["sparse_prefills"] > 0 and counters["queries_cut"] > 0
    check_against_reference(v32, prompts, cold, N)


@pytest.mark.slow
def test_preemption_and_resume_match_the_reference(v32: Path, counters: dict[str, int]) -> None:
    """40 blocks of 4 per group for five requests: some are preempted, their blocks in
    both groups freed, and recomputed on resume."""
    prompts = mixed_prompts(5, seed=5, lo=10, hi=30)
    with LLM(
        str(v32),
        dtype="float32",
        block_size=4,
        num_kv_blocks=40,
        max_model_len=64,
        enable_prefix_caching=False,
    ) as llm:
        got = run(llm, prompts, _greedy(24))
        stats = llm.get_stats()
    assert stats["num_preemptions"] > 0 and stats["num_free_blocks"] == 40
    assert counters["sparse_decodes"] > 0
    check_against_reference(v32, prompts, got, 24)


@pytest.mark.slow
def test_release_layout_fp8_sharded_with_mtp_layer(
    v32: Path, tmp_path: Path, counters: dict[str, int]
) -> None:
    """The checkpoint as DeepSeek ships it loads unchanged and runs the values it
    encodes (the reference decodes the FP8 blocks itself); its MTP layer drafts."""
    release = write_release_layout(v32, tmp_path / "release")
    assert not (release / "model.safetensors").exists()
    prompts = mixed_prompts(2, seed=7, lo=25, hi=35)
    with LLM(str(release), dtype="float32") as llm:
        got = run(llm, prompts, _greedy(8))
    assert counters["queries_cut"] > 0
    check_against_reference(release, prompts, got, 8, hf=False)
    spec = {"method": "mtp", "num_speculative_tokens": 2}  # its FP8 MTP layer drafts
    with LLM(str(release), dtype="float32", speculative_config=spec) as llm:
        assert run(llm, prompts, _greedy(8)) == got
        assert llm.get_stats()["spec_num_drafts"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_ngram_verify_rows_equal_plain_decoding(
    v32: Path, counters: dict[str, int], async_scheduling: bool
) -> None:
    """Verify steps (several rows per sequence, each selecting its own top k) give the
    plain greedy tokens; the drafts are rejected and their entries overwritten."""
    prompts = [p + p[:10] for p in mixed_prompts(3, seed=9, lo=15, hi=30)]
    with LLM(str(v32), dtype="float32") as llm:
        plain = run(llm, prompts, _greedy())
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    with LLM(
        str(v32), dtype="float32", async_scheduling=async_scheduling, speculative_config=spec
    ) as llm:
        assert run(llm, prompts, _greedy()) == plain
        assert llm.get_stats()["spec_num_drafts"] > 0
    assert counters["sparse_decodes"] > 0 and counters["queries_cut"] > 0


@pytest.mark.slow
def test_bf16_weights_keep_the_indexer_scoring_in_fp32(v32: Path, tmp_path: Path) -> None:
    """A bf16 run of the release holds `weights_proj` and the key LayerNorm in fp32 (as
    DeepSeek's reference does) and the FP8 `wk` decoded into the run dtype."""
    from safetensors import safe_open

    from laneserve.kernels import get_kernels
    from laneserve.model.deepseek_v32.model import DeepseekV32Model
    from laneserve.model.loader import resolve_checkpoint
    from laneserve.model.registry import open_weights

    release, cpu = write_release_layout(v32, tmp_path / "release"), torch.device("cpu")
    ckpt = resolve_checkpoint(str(release), "bfloat16", cpu)
    store = open_weights(ckpt, cpu, torch.bfloat16)
    model = DeepseekV32Model(ckpt.arch, get_kernels(cpu), store, cpu, torch.bfloat16, 64)
    ix = model.layers[1].attn.indexer
    assert ix.weights_proj.dtype == torch.float32
    assert all(t.dtype == torch.float32 for t in ix.k_norm)
    name = "model.layers.1.self_attn.indexer.weights_proj.weight"
    index = json.loads((release / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(release / index[name]), "pt") as f:
        shipped = f.get_tensor(name)
    assert shipped.dtype == torch.bfloat16 and torch.equal(ix.weights_proj, shipped.float())


def _variant(src: Path, out: Path, **cfg: object) -> Path:
    shutil.copytree(src, out)
    config = json.loads((src / "config.json").read_text())
    config.update(cfg)
    (out / "config.json").write_text(json.dumps(config))
    return out


def _as_v3(src: Path, out: Path) -> Path:
    """The same checkpoint without its indexers, as a DeepSeek V3 one."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    state = load_file(str(src / "model.safetensors"))
    save_file(
        {k: v for k, v in state.items() if ".indexer." not in k}, str(out / "model.safetensors")
    )
    config = json.loads((src / "config.json").read_text())
    config.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.slow
def test_topk_above_the_context_is_v3_and_a_small_topk_is_not(
    v32: Path, tmp_path: Path, counters: dict[str, int]
) -> None:
    dense = _variant(v32, tmp_path / "dense", index_topk=4096)
    v3 = _as_v3(v32, tmp_path / "v3")
    prompts = mixed_prompts(3, seed=5, lo=20, hi=40)
    params = _greedy(8, logprobs=3)
    with LLM(str(dense), dtype="float32") as llm:
        outs_dense = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
    assert counters == {"sparse_prefills": 0, "sparse_decodes": 0, "queries_cut": 0}
    got_dense = [o.outputs[0].token_ids for o in outs_dense]
    with LLM(str(v3), dtype="float32") as llm:
        assert run(llm, prompts, _greedy(8)) == got_dense
    with LLM(str(v32), dtype="float32") as llm:
        outs_sparse = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
    sparse_first = [o.outputs[0].logprobs[0] for o in outs_sparse]  # type: ignore[index]
    dense_first = [o.outputs[0].logprobs[0] for o in outs_dense]  # type: ignore[index]
    moved = [
        set(a) != set(b) or max(abs(a[t].logprob - b[t].logprob) for t in a) > 1e-3
        for a, b in zip(sparse_first, dense_first, strict=True)
    ]
    assert any(moved), "index_topk=6 left every first-token logprob where V3 has it"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"index_topk": None}, "index_topk must be a positive int, got None"),
        ({"index_topk": 0}, "index_topk must be a positive int, got 0"),
        ({"index_n_heads": "64"}, "index_n_heads must be a positive int"),
        ({"index_head_dim": True}, "index_head_dim must be a positive int"),
        ({"index_head_dim": 4}, r"qk_rope_head_dim=8 must be an even int <= index_head_dim"),
        ({"q_lora_rank": None}, "q_lora_rank is required"),
        ({"rope_interleave": False}, "rope_interleave must be true"),
        ({"indexer_rope_interleave": True}, "indexer_rope_interleave must be false"),
    ],
)
def test_bad_config_is_refused_by_name(change: dict, message: str) -> None:
    cfg = release_config(**change)
    cfg = {k: v for k, v in cfg.items() if v is not None or k != "index_topk"}
    with pytest.raises(
        UnsupportedModelError, match=f"DeepseekV32ForCausalLM config.json: {message}"
    ):
        ArchConfig.from_hf(cfg)


@pytest.mark.slow  # the module's checkpoint is built by transformers
def test_config_that_does_not_fit_the_tensors_is_refused(v32: Path, tmp_path: Path) -> None:
    bad = _variant(v32, tmp_path / "bad", index_n_heads=8)
    with pytest.raises(ValueError, match=r"indexer\.wq_b\.weight' has shape \(256, 32\), expected"):
        LLM(str(bad), dtype="float32")


def test_release_config_is_read() -> None:
    arch = ArchConfig.from_hf(release_config())
    assert arch.indexer is not None and arch.deepseek is not None
    assert (arch.indexer.index_topk, arch.indexer.index_n_heads) == (6, 16)
    assert arch.indexer.index_head_dim == 16


@pytest.mark.slow
def test_mtp_without_the_mtp_layer_is_refused(v32: Path) -> None:
    """MTP speculation runs the checkpoint's own MTP layer (`test_deepseek_v32_mtp.py`);
    this checkpoint has none (num_nextn_predict_layers 0, no `model.layers.3.*`)."""
    with pytest.raises(Exception, match=r"carries no MTP layer \(model\.layers\.3\.eh_proj"):
        LLM(
            str(v32),
            dtype="float32",
            speculative_config={"method": "mtp", "num_speculative_tokens": 1},
        )
