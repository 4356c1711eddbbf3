"""Block-scaled FP8 / MXFP4 checkpoints with their linear weights resident as stored
(`quantized_weights="resident"`, kernels/scaled.py): the same greedy tokens as the
dequantize-at-load path (and, for V3, as the plain fp32 checkpoint the fp8 one encodes),
the packed layouts engaged, the grouped experts fed only the chosen experts' weights, and
the resident bytes within 10 % of the checkpoint's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from laneserve import LLM
from laneserve.kernels import CpuKernels, Kernels, PackedWeight, get_kernels
from laneserve.model.footprint import checkpoint_bytes, resident_bytes
from laneserve.model.loader import Checkpoint, resolve_checkpoint
from laneserve.model.registry import family_for, open_weights
from tests.e2e.test_tiny_models import mixed_prompts, run
from tests.models.release_deepseek_v4 import HEAD_DIM, HEADS, O_GROUPS, O_LORA, build_release_v4
from tests.models.test_deepseek_v4 import GREEDY, prompts_of
from tests.models.test_fp8_loader import _fp8_copy

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("v4resident")
    return build_release_v4(root / "release", root / "reference", seed=5)


@pytest.fixture(scope="module")
def v3_fp8(deepseek_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("v3fp8")
    _fp8_copy(deepseek_models["v3"], root / "fp8", root / "plain")
    return root / "fp8"


@pytest.fixture(scope="module")
def ck() -> CpuKernels:
    kernels = get_kernels(CPU)
    if not isinstance(kernels, CpuKernels):
        pytest.skip("the CPU kernels do not build here")
    return kernels


def _model(ckpt: Checkpoint, kernels: Kernels, act_dtype: torch.dtype = torch.float32) -> Any:
    store = open_weights(ckpt, CPU, act_dtype)
    return family_for(ckpt.arch).model_class(ckpt.arch, kernels, store, CPU, act_dtype, 64), store


def _layouts(root: Any) -> set[str]:
    found: set[str] = set()
    stack, seen = [root], set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, PackedWeight):
            found.add(obj.layout)
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif type(obj).__module__.startswith("laneserve.model") and hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return found


def test_auto_is_resident_on_cpu_and_flag_is_checked(v3_fp8: Path) -> None:
    assert resolve_checkpoint(str(v3_fp8), "float32", CPU).quantized_weights == "resident"
    # auto: dequantized where the kernels are torch's (no extension, --no-use-kernels, CUDA)
    torch_kernels = resolve_checkpoint(str(v3_fp8), "float32", CPU, native_scaled=False)
    assert torch_kernels.quantized_weights == "dequantized"
    deq = resolve_checkpoint(str(v3_fp8), "float32", CPU, quantized_weights="dequantized")
    assert deq.quantized_weights == "dequantized"
    with pytest.raises(ValueError, match="quantized_weights"):
        resolve_checkpoint(str(v3_fp8), "float32", CPU, quantized_weights="fp8")


def test_v3_fp8_engages(v3_fp8: Path, ck: CpuKernels) -> None:
    ckpt = resolve_checkpoint(str(v3_fp8), "float32", CPU)
    model, store = _model(ckpt, ck)
    assert "scaled-fp8-blocked16" in _layouts(model)
    w = store.quantized_linear("model.layers.1.self_attn.kv_a_proj_with_mqa.weight")
    assert w is not None and w.fmt == "fp8" and w.shape == (40, 64)  # partial 16-blocks
    assert store.quantized_linear("model.layers.1.input_layernorm.weight") is None
    deq = resolve_checkpoint(str(v3_fp8), "float32", CPU, quantized_weights="dequantized")
    assert "scaled-fp8-blocked16" not in _layouts(_model(deq, ck)[0])


@pytest.mark.slow
def test_v3_fp8_resident_equals_dequantized(v3_fp8: Path) -> None:
    prompts = mixed_prompts(3, seed=11)
    with LLM(str(v3_fp8), dtype="float32") as llm:
        resident = run(llm, prompts)
    with LLM(str(v3_fp8), dtype="float32", quantized_weights="dequantized") as llm:
        assert run(llm, prompts) == resident


def test_v4_release_engages_both_formats(release: tuple[Path, Path], ck: CpuKernels) -> None:
    ckpt = resolve_checkpoint(str(release[0]), "float32", CPU)
    model, store = _model(ckpt, ck)
    assert {"scaled-fp8-blocked16", "scaled-fp4-blocked16"} <= _layouts(model)
    expert = store.quantized_linear("layers.1.ffn.experts.3.w2.weight")
    assert expert is not None and expert.fmt == "fp4" and expert.scale.dtype == torch.uint8


@pytest.mark.slow
def test_v4_release_resident_equals_dequantized(release: tuple[Path, Path]) -> None:
    prompts = prompts_of([150, 37, 9], seed=21)
    with LLM(str(release[0]), dtype="float32", max_model_len=512) as llm:
        resident = run(llm, prompts, GREEDY)
    kw: dict[str, Any] = {"quantized_weights": "dequantized", "max_model_len": 512}
    with LLM(str(release[0]), dtype="float32", **kw) as llm:
        assert run(llm, prompts, GREEDY) == resident


def test_v4_wo_a_is_resident_as_its_groups(release: tuple[Path, Path], ck: CpuKernels) -> None:
    """wo_a [G R, H D / G] stays in its stored fp8 bytes as G scaled linears over its row
    slices (every layer and the MTP layer); the grouped product is bitwise the fp32 linear
    on each dequantized slice and close to the dense path's einsum."""
    from laneserve.kernels import scaled
    from laneserve.model.deepseek_v4.grouped import GroupedLinear
    from laneserve.model.deepseek_v4.mtp import load_deepseek_v4_mtp

    ckpt = resolve_checkpoint(str(release[0]), "float32", CPU)
    model, store = _model(ckpt, ck)
    mtp = load_deepseek_v4_mtp(store, model, ck, None, None)
    g, r, k = O_GROUPS, O_LORA, HEADS * HEAD_DIM // O_GROUPS
    for attn in [layer.attn for layer in model.layers] + [mtp.layer.attn]:
        assert attn.wo_a.dense is None and attn.wo_a.shape == (g, r, k)
        assert [p.weight.layout for p in attn.wo_a.parts] == ["scaled-fp8-blocked16"] * g
    w = store.quantized_linear("layers.1.attn.wo_a.weight")
    assert w is not None and w.shape == (g * r, k)
    spy = SpyKernels(ck)
    grouped = GroupedLinear(spy, w, g)  # type: ignore[arg-type]
    x = torch.randn(3, g, k, generator=torch.Generator().manual_seed(4))
    got = grouped(x, 0)
    assert [id(u) for u in spy.used] == [id(p.weight) for p in grouped.parts]
    dense = scaled.dequantize(w)
    slices = [ck.pack_linear_weight(dense[i * r : (i + 1) * r]) for i in range(g)]
    want = torch.cat([ck.linear(x[:, i].contiguous(), slices[i]) for i in range(g)], 1)
    assert torch.equal(got, want)
    torch.testing.assert_close(got, GroupedLinear(ck, dense, g)(x), rtol=1e-5, atol=1e-6)
    assert torch.equal(grouped(x[1:2]), got[1:2])  # one token: the same bits
    with pytest.raises(ValueError, match="does not split into 3 groups"):
        GroupedLinear(ck, w, 3)
    deq = resolve_checkpoint(str(release[0]), "float32", CPU, quantized_weights="dequantized")
    dense_attn = _model(deq, ck)[0].layers[1].attn
    assert dense_attn.wo_a.parts == [] and dense_attn.wo_a.dense is not None
    assert torch.equal(dense_attn.wo_a.dense.reshape(g * r, k), dense)


def test_v4_wo_a_holds_its_stored_bytes(release: tuple[Path, Path], ck: CpuKernels) -> None:
    """Resident, wo_a holds its checkpoint's fp8 value bytes, plus its block scales kept
    per row in fp32 (as every resident fp8 weight: 4 bytes per row per 128 columns);
    dequantized in bf16 it holds 2 bytes a value."""
    from safetensors import safe_open

    out, name = release[0], "layers.1.attn.wo_a"
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    stored = {}
    for suffix in ("weight", "scale"):
        with safe_open(str(out / index[f"{name}.{suffix}"]), "pt") as f:
            t = f.get_tensor(f"{name}.{suffix}")
        stored[suffix] = t.numel() * t.element_size()
    n, k = O_GROUPS * O_LORA, HEADS * HEAD_DIM // O_GROUPS
    assert stored == {"weight": n * k, "scale": 1}  # e4m3 values, one ue8m0 128 x 128 block
    held = {}
    for mode in ("resident", "dequantized"):
        ckpt = resolve_checkpoint(str(out), "bfloat16", CPU, quantized_weights=mode)
        held[mode] = resident_bytes(_model(ckpt, ck)[0].layers[1].attn.wo_a)
    assert held["resident"] == stored["weight"] + n * -(-k // 128) * 4, held
    assert held["dequantized"] == 2 * n * k, held


class SpyKernels:
    """CpuKernels whose `linear` records which packed weights it multiplies by."""

    def __init__(self, inner: CpuKernels) -> None:
        self.inner, self.name, self.used = inner, inner.name, []

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)

    def linear(self, x: torch.Tensor, w: PackedWeight, *args: Any) -> torch.Tensor:
        self.used.append(w)
        return self.inner.linear(x, w, *args)


def _routed_reads(spy: SpyKernels, experts: list[Any], chosen: torch.Tensor) -> None:
    used = {id(w) for w in spy.used}
    picked = set(chosen.flatten().tolist())
    assert 0 < len(picked) < len(experts)
    for e, (w13, w2) in enumerate(experts):
        hit = {id(w13.weight), id(w2.weight)} & used
        assert hit == ({id(w13.weight), id(w2.weight)} if e in picked else set()), e


def test_v4_grouped_experts_read_only_the_chosen(
    release: tuple[Path, Path], ck: CpuKernels
) -> None:
    from laneserve.model.deepseek_v4.moe import V4MoE

    ckpt = resolve_checkpoint(str(release[0]), "float32", CPU)
    store = open_weights(ckpt, CPU, torch.float32)
    spy = SpyKernels(ck)
    assert ckpt.arch.v4 is not None
    moe = V4MoE(ckpt.arch.v4, spy, store, "layers.1.ffn", hashed=False)  # type: ignore[arg-type]
    assert moe.stacked is None and moe.experts[0].w2.weight.layout == "scaled-fp4-blocked16"
    x = torch.randn(2, ckpt.arch.hidden_size, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([1, 2])
    _, chosen = moe.route(x, ids)
    spy.used.clear()
    moe(x, ids)
    _routed_reads(spy, [(e.w13, e.w2) for e in moe.experts], chosen)


def test_v3_grouped_experts_read_only_the_chosen(v3_fp8: Path, ck: CpuKernels) -> None:
    from laneserve.model.layers.moe import MoE, route

    ckpt = resolve_checkpoint(str(v3_fp8), "float32", CPU)
    store = open_weights(ckpt, CPU, torch.float32)
    spy = SpyKernels(ck)
    assert ckpt.arch.deepseek is not None
    moe = MoE(ckpt.arch.deepseek, spy, store, "model.layers.2.mlp")  # type: ignore[arg-type]
    assert moe.w2[0].weight.layout == "scaled-fp8-blocked16"
    x = torch.randn(1, ckpt.arch.hidden_size, generator=torch.Generator().manual_seed(1))
    _, chosen = route(x.float() @ moe.gate.t(), moe.bias, moe.p)
    spy.used.clear()
    moe(x)
    _routed_reads(spy, list(zip(moe.w13, moe.w2, strict=True)), chosen)


def test_v4_resident_bytes_near_the_checkpoint(release: tuple[Path, Path]) -> None:
    """bf16 run (the release's own dtype for its unquantized tensors): the model and its
    MTP layer hold within 10 % of the checkpoint's tensor bytes; dequantized they would
    hold far more."""
    from laneserve.model.deepseek_v4.mtp import load_deepseek_v4_mtp

    out = release[0]
    kernels = get_kernels(CPU)
    held = {}
    for mode in ("resident", "dequantized"):
        ckpt = resolve_checkpoint(str(out), "bfloat16", CPU, quantized_weights=mode)
        model, store = _model(ckpt, kernels)
        mtp = load_deepseek_v4_mtp(store, model, kernels, None, None)
        held[mode] = resident_bytes([model, mtp])
    stored = checkpoint_bytes(out)
    assert abs(held["resident"] - stored) <= 0.10 * stored, (held, stored)
    assert held["dequantized"] > 1.3 * stored, (held, stored)


def test_v3_resident_bytes_below_dequantized(v3_fp8: Path) -> None:
    """fp32 run of the tiny fp8 V3 (16 x 16 blocks, so its fp32 scales repeated per row
    weigh 4 bytes per 16 values): the model holds about half the bytes of the same model
    dequantized, whose projections are 4 bytes a weight."""
    kernels = get_kernels(CPU)
    held = {}
    for mode in ("resident", "dequantized"):
        ckpt = resolve_checkpoint(str(v3_fp8), "float32", CPU, quantized_weights=mode)
        held[mode] = resident_bytes(_model(ckpt, kernels)[0])
    stored = checkpoint_bytes(v3_fp8)
    assert held["resident"] < 0.55 * held["dequantized"], held
    assert held["resident"] < 1.4 * stored < held["dequantized"], (held, stored)


def test_auto_dequantizes_with_torch_kernels(v3_fp8: Path) -> None:
    """The worker resolves auto after picking its kernels: with the torch ones (here
    --no-kernels) the fp8 weights are dequantized at load, not multiplied row block by
    row block on every call."""
    from laneserve import SamplingParams
    from laneserve.kernels import TorchKernels

    with LLM(str(v3_fp8), dtype="float32", use_kernels=False, max_model_len=64) as llm:
        worker = llm.engine.client.worker
        assert isinstance(worker.kernels, TorchKernels)
        assert worker.ckpt.quantized_weights == "dequantized"
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))
        assert len(out[0].outputs[0].token_ids) == 3
