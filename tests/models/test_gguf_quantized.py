"""GGUF linear weights kept quantized (`gguf_weights="quantized"`): the loader hands out
`QuantWeight`s with the q/k row interleave undone, and greedy decoding gives exactly the
tokens and log-probabilities of the dequantized fp32 path (the kernel's reference)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from laneserve import LLM, SamplingParams
from laneserve.kernels import CpuKernels, quant
from laneserve.kernels.quant import QuantWeight
from laneserve.model.loader import resolve_checkpoint, resolve_gguf_weights
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


@pytest.mark.parametrize(
    ("requested", "dtype", "int8_dot", "mode"),
    [
        ("auto", "auto", True, "q8-dot"),  # the fast path where the CPU has VNNI
        ("auto", "bfloat16", True, "q8-dot"),
        ("auto", "float32", True, "quantized"),  # float32 means exact
        ("auto", "auto", False, "quantized"),  # no VNNI: the exact path
        ("quantized", "auto", True, "quantized"),  # a named mode stays
        ("q8-dot", "float32", False, "q8-dot"),
        ("dequantized", "auto", True, "dequantized"),
    ],
)
def test_auto_gguf_weights_resolve(requested: str, dtype: str, int8_dot: bool, mode: str) -> None:
    assert resolve_gguf_weights(requested, dtype, int8_dot) == mode


def _default_run(path: Path, **kwargs: object) -> tuple[str, str, list[list[int]]]:
    """(the resolved mode, the checkpoint's activations, greedy tokens) of `gguf_weights`
    left at its default."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(path), max_model_len=64, **kwargs) as llm:  # type: ignore[arg-type]
        worker = llm.engine.client.worker  # type: ignore[attr-defined]
        outs = llm.generate([{"prompt_token_ids": [5, 9, 11]}], params, use_tqdm=False)
        vnni = isinstance(worker.kernels, CpuKernels) and worker.kernels.vnni
        mode, act = worker.gguf_weights, worker.ckpt.gguf_activations
    assert act == ("q8" if mode == "q8-dot" else "fp32")
    return mode, ("vnni" if vnni else "no-vnni"), [o.outputs[0].token_ids for o in outs]


def test_default_gguf_weights_engage_by_cpu_and_float32_stays_exact(tiny_gguf: Path) -> None:
    mode, cpu, _ = _default_run(tiny_gguf, worker_mode="thread")
    assert mode == ("q8-dot" if cpu == "vnni" else "quantized"), (mode, cpu)
    exact_mode, _, exact = _default_run(tiny_gguf, worker_mode="thread", dtype="float32")
    assert exact_mode == "quantized"
    assert (
        exact
        == _default_run(tiny_gguf, worker_mode="thread", dtype="float32", gguf_weights="quantized")[
            2
        ]
    )
