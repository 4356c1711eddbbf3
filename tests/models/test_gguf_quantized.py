"""GGUF linear weights kept quantized (`gguf_weights="quantized"`): the loader hands out
`QuantWeight`s with the q/k row interleave undone, and greedy decoding gives exactly the
tokens and log-probabilities of the dequantized fp32 path (the kernel's reference)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from laneserve import LLM, SamplingParams
from laneserve.kernels import quant
from laneserve.kernels.quant import QuantWeight
from laneserve.model.loader import resolve_checkpoint
from laneserve.model.registry import open_weights
from tests.tiny_models import build_tiny_model, write_tiny_gguf

QUANT = {
    "q_proj.weight": "Q4_1",
    "k_proj.weight": "Q4_0",
    "v_proj.weight": "Q8_0",
    "o_proj.weight": "Q4_1",
    "gate_proj.weight": "Q4_0",
    "up_proj.weight": "Q4_1",
    "down_proj.weight": "Q8_0",
    "embed_tokens.weight": "Q8_0",
}
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gguf_quant")
    hf = build_tiny_model(root / "hf", "llama", seed=7, tie=True)
    (root / "file").mkdir()
    return write_tiny_gguf(hf, root / "file" / "tiny.gguf", "llama", QUANT)


def test_loader_keeps_linear_weights_quantized(tiny_gguf: Path) -> None:
    ckpt = resolve_checkpoint(str(tiny_gguf), "float32", CPU, "quantized")
    assert ckpt.gguf_quantized == tiny_gguf
    store = open_weights(ckpt, CPU, torch.float32)
    for suffix, kind in QUANT.items():
        name = (
            "lm_head.weight" if suffix.startswith("embed") else f"model.layers.1.self_attn.{suffix}"
        )
        if suffix.split("_")[0] in ("gate", "up", "down"):
            name = f"model.layers.1.mlp.{suffix}"
        q = store.quantized_linear(name)
        assert isinstance(q, QuantWeight) and q.qtype == kind.lower()
        dense_name = "model.embed_tokens.weight" if name == "lm_head.weight" else name
        # the same values as the converted (dequantized, un-interleaved) checkpoint
        assert torch.equal(quant.dequantize(q), store(dense_name, torch.float32))
    assert store.quantized_linear("model.norm.weight") is None  # F32: read densely
    dense = resolve_checkpoint(str(tiny_gguf), "float32", CPU, "dequantized")
    assert dense.gguf_quantized is None
    assert open_weights(dense, CPU, torch.float32).quantized_linear("lm_head.weight") is None


def _greedy(path: Path, mode: str) -> list[tuple[list[int], float | None]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in ([5, 9, 11], [40, 2, 7, 7, 100], [3])]
    with LLM(str(path), dtype="float32", gguf_weights=mode, max_model_len=64) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in outs]


def test_quantized_greedy_equals_dequantized_fp32(tiny_gguf: Path) -> None:
    got = _greedy(tiny_gguf, "quantized")
    assert all(logprob is not None for _, logprob in got)
    assert got == _greedy(tiny_gguf, "dequantized")


def _q8_greedy(path: Path, **kwargs: object) -> tuple[list[list[int]], dict]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ([5, 9, 11, 5, 9, 11, 5, 9], [40, 2, 7, 40, 2])]
    with LLM(str(path), gguf_weights="q8-dot", max_model_len=64, **kwargs) as llm:  # type: ignore[arg-type]
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.stats()
    return [o.outputs[0].token_ids for o in outs], stats


def test_q8_dot_speculative_equals_plain(tiny_gguf: Path) -> None:
    """q8-dot verify rows take the same int8 arithmetic as the decode rows they replace
    (the embedded model's version of this check is slow)."""
    plain, _ = _q8_greedy(tiny_gguf, async_scheduling=False)
    spec, stats = _q8_greedy(
        tiny_gguf,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
    )
    assert stats["spec_num_drafts"] > 0 and stats["spec_num_accepted"] > 0, stats
    assert spec == plain
