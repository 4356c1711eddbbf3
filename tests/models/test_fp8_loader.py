"""Block-quantized FP8 checkpoints (release layout: sharded, index json) dequantize at
load to exactly the weights they encode; unsupported quantization is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from laneserve import LLM
from laneserve.model.layers import fp8
from laneserve.model.loader import resolve_checkpoint
from laneserve.model.registry import open_weights
from tests.e2e.test_tiny_models import mixed_prompts, run

BLOCK = (16, 16)  # tiny blocks: the tiny model's shapes (40 x 64, 96 x 32 ...) do not divide


def _encodable(
    shape: tuple[int, int], block: tuple[int, int], seed: int, std: float = 0.01
) -> tuple:
    """(fp8 values, scale_inv, the fp32 matrix they encode), computed by hand."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(shape, generator=g) * 100).to(torch.float8_e4m3fn)
    grid = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    scale = 2.0 ** torch.randint(-2, 2, grid, generator=g).float() * (std / 100)
    full = scale.repeat_interleave(block[0], 0)[: shape[0]]
    full = full.repeat_interleave(block[1], 1)[:, : shape[1]]
    return q, scale, q.float() * full


def test_dequantize_ceil_blocks() -> None:
    q, scale, want = _encodable((200, 300), (128, 128), seed=0)
    assert scale.shape == (2, 3)
    assert torch.equal(fp8.dequantize(q, scale, (128, 128)), want)
    with pytest.raises(ValueError, match="scale shape"):
        fp8.dequantize(q, scale[:1], (128, 128))


def _fp8_copy(src: Path, out: Path, plain: Path) -> dict[str, torch.Tensor]:
    """`src` re-encoded: its projections as fp8 blocks in two shards with an index (out),
    and the fp32 weights that encodes (plain). Returns those fp32 weights."""
    weights = load_file(str(src / "model.safetensors"))
    quant, exact = {}, {}
    for i, (name, w) in enumerate(sorted(weights.items())):
        if w.dim() == 2 and "_proj" in name:
            q, scale, exact[name] = _encodable(tuple(w.shape), BLOCK, i, float(w.std()))
            quant[name], quant[f"{name}_scale_inv"] = q, scale
        else:
            quant[name] = exact[name] = w
    cfg = json.loads((src / "config.json").read_text())
    for d in (out, plain):
        d.mkdir()
        for f in src.iterdir():
            if f.name not in ("model.safetensors", "config.json"):
                (d / f.name).write_bytes(f.read_bytes())
    (plain / "config.json").write_text(json.dumps(cfg))
    save_file(exact, str(plain / "model.safetensors"))
    cfg["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(cfg))
    names = sorted(quant)
    shards = {"model-00001-of-00002.safetensors": names[::2]}
    shards["model-00002-of-00002.safetensors"] = names[1::2]
    weight_map = {}
    for file, part in shards.items():
        save_file({n: quant[n].contiguous() for n in part}, str(out / file))
        weight_map.update(dict.fromkeys(part, file))
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return exact


def test_fp8_checkpoint_loads_the_weights_it_encodes(
    deepseek_models: dict[str, Path], tmp_path: Path
) -> None:
    out, plain = tmp_path / "fp8", tmp_path / "plain"
    exact = _fp8_copy(deepseek_models["v3"], out, plain)
    ckpt = resolve_checkpoint(str(out), "float32", torch.device("cpu"))
    assert ckpt.fp8_block == BLOCK
    store = open_weights(ckpt, torch.device("cpu"), torch.float32)
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"  # 40 x 64: partial blocks
    assert store.has(f"{name}_scale_inv")
    for n in (name, "model.layers.2.mlp.experts.5.down_proj.weight", "lm_head.weight"):
        assert torch.equal(store(n), exact[n])
    prompts = mixed_prompts(3, seed=7)
    with LLM(str(out), dtype="float32") as llm:
        got = run(llm, prompts)
    with LLM(str(plain), dtype="float32") as llm:
        assert run(llm, prompts) == got


def test_unsupported_quantization_is_named(
    deepseek_models: dict[str, Path], tmp_path: Path
) -> None:
    d = tmp_path / "awq"
    d.mkdir()
    cfg = json.loads((deepseek_models["v3"] / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(fp8.UnsupportedQuantizationError, match="'awq'"):
        resolve_checkpoint(str(d), "float32", torch.device("cpu"))
