"""A DeepSeek V4 checkpoint as DeepSeek releases it (release_deepseek_v4.py: sharded
index, FP8 + ue8m0 block scales, MXFP4 experts, `attn.kv_norm`, `mtp.0`, the release
config keys) loads unchanged: greedy equals transformers fp32 on the same dequantized
values with prompts longer than the heavily compressed ratio (128), and the release's
MTP layer with k = 2 equals plain decoding. Every released tensor is read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from laneserve import LLM
from laneserve.model.arch import ArchConfig, UnsupportedModelError
from tests.e2e.test_tiny_models import run
from tests.models.release_deepseek_v4 import build_release_v4, release_config, release_spec
from tests.models.test_deepseek_mtp import _spec
from tests.models.test_deepseek_v4 import GREEDY, check_against_hf, prompts_of

LONG = [150, 37, 270]  # past 128 and 256: the HCA layer's entries are read


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("v4release")
    return build_release_v4(root / "release", root / "reference", seed=3)


def test_fixture_is_the_release_layout(release: tuple[Path, Path]) -> None:
    import json

    from safetensors import safe_open

    out, _ = release
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 3  # sharded
    assert "layers.0.attn.kv_norm.weight" in index and "mtp.0.attn.kv_norm.weight" in index
    assert not any(".attn.norm." in n or n.startswith("model.") for n in index)
    dtypes = {}
    for file in set(index.values()):
        with safe_open(str(out / file), "pt") as f:
            names = f.keys()
            dtypes.update({n: f.get_slice(n).get_dtype() for n in names})
    assert dtypes["layers.1.attn.wq_b.weight"] == "F8_E4M3"
    assert dtypes["layers.1.attn.wq_b.scale"] == "F8_E8M0"
    assert dtypes["layers.1.ffn.experts.3.w2.weight"] == "I8"
    assert dtypes["mtp.0.e_proj.scale"] == "F8_E8M0"
    assert dtypes["layers.1.attn.compressor.wkv.weight"] == "BF16"


def test_every_released_tensor_is_read(release: tuple[Path, Path]) -> None:
    from laneserve.kernels import get_kernels
    from laneserve.model.deepseek_v4.model import DeepseekV4Model
    from laneserve.model.deepseek_v4.mtp import load_deepseek_v4_mtp
    from laneserve.model.loader import WeightStore, resolve_checkpoint

    out, _ = release
    cpu = torch.device("cpu")
    ckpt = resolve_checkpoint(str(out), "float32", cpu)
    store = WeightStore(ckpt, cpu, torch.float32)
    read: set[str] = set()

    class Recording:
        def __init__(self) -> None:
            self.ckpt, self.has = store.ckpt, store.has

        def __call__(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
            read.add(name)
            return store(name, dtype)

    get = Recording()
    kernels = get_kernels(cpu)
    base = DeepseekV4Model(ckpt.arch, kernels, get, cpu, torch.float32, 80)
    load_deepseek_v4_mtp(get, base, kernels, None, None)
    assert read == set(release_spec(release_config()))


def test_save_pretrained_conversion_gives_released_names(deepseek_v4_model: Path, tmp_path: Path):
    """The older helper that renames transformers' save_pretrained output yields only
    names of the released list (layer and expert numbers aside)."""
    from safetensors.torch import load_file

    from tests.models.tiny_deepseek_v4 import to_release_layout

    def pattern(name: str) -> str:
        return re.sub(r"\.\d+\.", ".N.", name)

    converted = load_file(
        str(to_release_layout(deepseek_v4_model, tmp_path / "r") / "model.safetensors")
    )
    released = {pattern(n) for n in release_spec(release_config())}
    assert {pattern(n) for n in converted} <= released


@pytest.mark.slow
def test_greedy_matches_transformers_past_the_hca_ratio(release: tuple[Path, Path]) -> None:
    out, reference = release
    prompts = prompts_of(LONG, seed=12)
    with LLM(str(out), dtype="float32", max_model_len=512) as llm:
        got = run(llm, prompts, GREEDY)
    check_against_hf(reference, prompts, got)


@pytest.mark.slow
def test_release_mtp_k2_equals_plain(release: tuple[Path, Path]) -> None:
    out, reference = release
    prompts = prompts_of(LONG, seed=13)
    with LLM(str(out), dtype="float32", max_model_len=512, **_spec(2)) as llm:
        got = run(llm, prompts, GREEDY)
        stats = llm.get_stats()
    assert stats["spec_num_drafts"] > 0
    check_against_hf(reference, prompts, got)


def test_release_config_read_as_transformers_reads_it() -> None:
    from transformers import DeepseekV4Config

    cfg = release_config()
    p = ArchConfig.from_hf(cfg).v4
    assert p is not None
    hf = DeepseekV4Config(**{k: v for k, v in cfg.items() if k != "architectures"})
    assert list(p.layer_types) == hf.layer_types
    assert list(p.mlp_layer_types) == hf.mlp_layer_types
    assert p.rope_dim == hf.qk_rope_head_dim
    for ours, theirs in ((p.main_rope, hf.rope_parameters["main"]),
                         (p.compress_rope, hf.rope_parameters["compress"])):  # fmt: skip
        for key in ("rope_type", "rope_theta", "factor", "original_max_position_embeddings"):
            assert ours.get(key) == theirs.get(key), key
    assert p.compress_rope["rope_type"] == "yarn"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rope_scaling": {"type": "longrope", "factor": 4}}, "rope type 'longrope'"),
        ({"rope_scaling": {"type": "yarn", "rope_type": "linear"}}, "rope_type 'linear'"),
        ({"compress_ratios": [0, 4, 64, 4, 0]}, r"values \[64\]"),
        ({"compress_ratios": [0, 4, 128, 4, 4]}, "MTP layer"),
        ({"compress_ratios": [0, 4, 128]}, "one ratio per layer"),
        ({"num_hash_layers": -1}, "num_hash_layers"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
        ({"expert_dtype": "fp2"}, "expert_dtype 'fp2'"),
        ({"quantization_config": {"quant_method": "fp8", "scale_fmt": "e5m2"}}, "scale_fmt"),
        ({"quantization_config": {"quant_method": "awq"}}, "quant_method"),
        ({"layer_types": ["sliding_attention", "full_attention"] * 2}, "full_attention"),
        ({"mlp_layer_types": ["dense"] * 4}, "dense"),
    ],
)
def test_unknown_release_config_values_are_errors(change: dict, message: str) -> None:
    with pytest.raises(UnsupportedModelError, match=message):
        ArchConfig.from_hf(release_config(**change))


def test_release_config_with_padding_zeros_after_the_mtp_entry() -> None:
    cfg = release_config(compress_ratios=[0, 4, 128, 4, 0, 0, 0])
    p = ArchConfig.from_hf(cfg).v4
    assert p is not None and len(p.layer_types) == 4


def test_v41_is_refused_saying_what_is_missing() -> None:
    cfg = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
           "text_config": release_config(), "vision_config": {"hidden_size": 64}}  # fmt: skip
    with pytest.raises(UnsupportedModelError, match=r"text_config.*vision tower"):
        ArchConfig.from_hf(cfg)
