"""Resident fp8 / fp4 weights (`quantized_weights="resident"`): the MTP layers of V3 and
V4 take them too (speculative greedy equals the dequantized plain run), and a checkpoint
whose block scales do not fit its weights is refused at load, naming the tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from laneserve import LLM
from laneserve.kernels import get_kernels
from laneserve.model.deepseek.mtp import load_deepseek_mtp
from laneserve.model.deepseek_v4.mtp import load_deepseek_v4_mtp
from laneserve.model.loader import ModelLoadError, resolve_checkpoint
from laneserve.model.registry import family_for, open_weights
from tests.e2e.test_tiny_models import mixed_prompts, run
from tests.models.release_deepseek_v4 import build_release_v4
from tests.models.test_deepseek_mtp import _spec
from tests.models.test_deepseek_v4 import GREEDY, prompts_of
from tests.models.test_fp8_loader import _fp8_copy
from tests.tiny_models import add_mtp_layer, build_tiny_deepseek

CPU = torch.device("cpu")
FP8 = "scaled-fp8-blocked16"
FP4 = "scaled-fp4-blocked16"


@pytest.fixture(scope="module")
def v3_mtp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny V3 with its MTP layer, re-encoded as fp8 blocks (and the fp32 it encodes)."""
    root = tmp_path_factory.mktemp("v3mtp")
    src = add_mtp_layer(build_tiny_deepseek(root / "src", 3, seed=3), seed=4)
    _fp8_copy(src, root / "fp8", root / "plain")
    return root / "fp8", root / "plain"


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("v4checks")
    return build_release_v4(root / "release", root / "reference", seed=7)


def _loaded(model: Path, mtp_loader: Any) -> tuple[Any, Any]:
    ckpt = resolve_checkpoint(str(model), "float32", CPU)
    kernels = get_kernels(CPU)
    store = open_weights(ckpt, CPU, torch.float32)
    base = family_for(ckpt.arch).model_class(ckpt.arch, kernels, store, CPU, torch.float32, 64)
    return base, mtp_loader(store, base, kernels, None, None)


def test_v3_mtp_head_is_resident(v3_mtp: tuple[Path, Path]) -> None:
    _, head = _loaded(v3_mtp[0], load_deepseek_mtp)
    assert head.eh_proj.weight.layout == FP8
    assert head.layer.attn.o_proj.weight.layout == FP8


@pytest.mark.slow
def test_v3_mtp_k2_resident_equals_plain(v3_mtp: tuple[Path, Path]) -> None:
    fp8_dir, plain = v3_mtp
    prompts = mixed_prompts(3, seed=5)
    with LLM(str(fp8_dir), dtype="float32", **_spec(2)) as llm:
        got = run(llm, prompts)
        assert llm.get_stats()["spec_num_drafts"] > 0
    with LLM(str(fp8_dir), dtype="float32", quantized_weights="dequantized") as llm:
        assert run(llm, prompts) == got
    with LLM(str(plain), dtype="float32") as llm:  # the fp32 values the fp8 encodes
        assert run(llm, prompts) == got


def test_v4_mtp_head_is_resident(release: tuple[Path, Path]) -> None:
    _, head = _loaded(release[0], load_deepseek_v4_mtp)
    assert head.e_proj.weight.layout == FP8 and head.h_proj.weight.layout == FP8
    assert {p.weight.layout for p in head.layer.attn.wo_a.parts} == {FP8}
    layouts = {e.w2.weight.layout for e in head.layer.ffn.experts}
    assert layouts == {FP4}


@pytest.mark.slow
def test_v4_mtp_k2_resident_equals_dequantized_plain(release: tuple[Path, Path]) -> None:
    prompts = prompts_of([140, 20], seed=23)
    kw: dict[str, Any] = {"dtype": "float32", "max_model_len": 512}
    with LLM(str(release[0]), **kw, **_spec(2)) as llm:
        got = run(llm, prompts, GREEDY)
        assert llm.get_stats()["spec_num_drafts"] > 0
    with LLM(str(release[0]), quantized_weights="dequantized", **kw) as llm:
        assert run(llm, prompts, GREEDY) == got


def _copy_with(src: Path, dst: Path, name: str, tensor: torch.Tensor) -> Path:
    """`src` copied to `dst` with tensor `name` replaced (in the shard that holds it)."""
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    path = dst / index[name]
    tensors = load_file(str(path))
    tensors[name] = tensor
    save_file(tensors, str(path))
    return dst


def _refused(model: Path, name: str, match: str, mode: str = "resident") -> None:
    ckpt = resolve_checkpoint(str(model), "float32", CPU, quantized_weights=mode)
    store = open_weights(ckpt, CPU, torch.float32)
    with pytest.raises(ModelLoadError, match=match) as err:
        if mode == "resident":
            store.quantized_linear(name)
        else:
            store(name)
    assert repr(name) in str(err.value)
    with pytest.raises(ModelLoadError, match=match):  # and the whole model refuses to load
        LLM(str(model), dtype="float32", quantized_weights=mode, max_model_len=512)


def test_v3_wrong_scale_grid_is_refused(v3_mtp: tuple[Path, Path], tmp_path: Path) -> None:
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"  # 40 x 64, 16 x 16 blocks
    scale = load_file(str(_shard_of(v3_mtp[0], f"{name}_scale_inv")))[f"{name}_scale_inv"]
    assert tuple(scale.shape) == (3, 4)
    bad = _copy_with(v3_mtp[0], tmp_path / "bad", f"{name}_scale_inv", scale[:, :3].contiguous())
    _refused(bad, name, r"scale grid")


def test_v3_non_finite_scale_is_refused(v3_mtp: tuple[Path, Path], tmp_path: Path) -> None:
    name = "model.layers.0.self_attn.o_proj.weight"
    scale = load_file(str(_shard_of(v3_mtp[0], f"{name}_scale_inv")))[f"{name}_scale_inv"]
    scale = scale.clone()
    scale[0, 0] = float("inf")
    bad = _copy_with(v3_mtp[0], tmp_path / "bad", f"{name}_scale_inv", scale)
    _refused(bad, name, "NaN or Inf")


@pytest.mark.parametrize(
    ("name", "cut"),
    [
        ("layers.1.ffn.experts.2.w1.scale", "cols"),  # fp4: one ue8m0 byte per 32 columns
        ("layers.0.attn.wq_a.scale", "rows"),  # fp8: one ue8m0 per 128 x 128 block
        ("layers.2.attn.wo_a.scale", "rows"),  # fp8, the grouped output projection
    ],
)
def test_v4_wrong_scale_shape_is_refused(
    release: tuple[Path, Path], tmp_path: Path, name: str, cut: str
) -> None:
    scale = load_file(str(_shard_of(release[0], name)))[name]
    bigger = torch.cat([scale, scale], dim=1 if cut == "cols" else 0).contiguous()
    bad = _copy_with(release[0], tmp_path / "bad", name, bigger)
    weight = name.removesuffix(".scale") + ".weight"
    _refused(bad, weight, "scale")
    _refused(bad, weight, "scale", mode="dequantized")


def test_v4_wo_a_of_the_wrong_shape_is_refused(release: tuple[Path, Path], tmp_path: Path):
    """A wo_a with a group's rows missing: named, with the shape config.json fixes."""
    name = "layers.1.attn.wo_a.weight"
    weight = load_file(str(_shard_of(release[0], name)))[name]
    bad = _copy_with(release[0], tmp_path / "bad", name, weight[16:].contiguous())
    _refused(bad, name, r"shape \(16, 64\), expected \(32, 64\)")
    _refused(bad, name, r"shape \(16, 64\), expected \(32, 64\)", mode="dequantized")


def _shard_of(model: Path, name: str) -> Path:
    index = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    return model / index[name]


@pytest.mark.slow
def test_torch_fallback_resident_equals_plain(v3_mtp: tuple[Path, Path]) -> None:
    """The torch product (CUDA's path, and CPUs without the extension) on resident fp8
    weights: the greedy tokens of the fp32 checkpoint the fp8 encodes, on torch kernels."""
    from tests.models.test_resident_weights import _layouts

    fp8_dir, plain = v3_mtp
    prompts = mixed_prompts(3, seed=9)
    kw: dict[str, Any] = {"dtype": "float32", "use_kernels": False}
    with LLM(str(fp8_dir), quantized_weights="resident", **kw) as llm:
        assert "scaled-fp8-torch" in _layouts(llm.engine.client.worker.model)
        got = run(llm, prompts)
    with LLM(str(plain), **kw) as llm:
        assert run(llm, prompts) == got
