"""The Kernels protocol: both implementations meet it; TorchKernels on low-precision
activations (CUDA's dtype)."""

from __future__ import annotations

import inspect

import pytest
import torch

from laneserve.kernels import CpuKernels, Kernels, TorchKernels, get_kernels
from laneserve.kernels import build as kbuild
from tests.kernels.helpers import DEVICES, attention_f64, make_attn_case, randn

PROTOCOL_OPS = sorted(
    name for name, value in vars(Kernels).items() if inspect.isfunction(value) and name[0] != "_"
)


def test_protocol_covers_the_extension_ops() -> None:
    """One contract per C++ op: the protocol's ops are exactly the ones the build checks,
    except pack_gguf_weight / pack_scaled_weight (repacks in Python, quant.py / scaled.py);
    the ops behind `linear` (AMX prompt rows, GGUF-packed weights, with fp32 or int8
    activations, block-scaled FP8 / MXFP4 weights) are the build's
    INTERNAL_OPS."""
    python_only = {"pack_gguf_weight", "pack_scaled_weight"}
    assert python_only <= set(PROTOCOL_OPS)
    assert sorted(kbuild.OPS) == sorted(set(PROTOCOL_OPS) - python_only)
    internal = {"linear_prefill", "quant_linear", "quantize_q8", "quant_linear_q8", "scaled_linear"}
    assert set(kbuild.INTERNAL_OPS) == internal
    assert not set(kbuild.INTERNAL_OPS) & set(PROTOCOL_OPS)


@pytest.mark.parametrize("impl", [CpuKernels, TorchKernels])
def test_implementations_match_the_protocol(impl: type) -> None:
    """Each op exists with the protocol's parameters: names, kinds, defaults, annotations
    (callers pass some of them by keyword)."""
    for name in PROTOCOL_OPS:
        want = inspect.signature(getattr(Kernels, name))
        got = inspect.signature(getattr(impl, name))
        assert got == want, f"{impl.__name__}.{name}{got} != Kernels.{name}{want}"


def test_get_kernels_returns_a_kernels(ck: CpuKernels, tk: TorchKernels) -> None:
    assert isinstance(ck, Kernels) and isinstance(tk, Kernels)
    assert isinstance(get_kernels(torch.device("cpu")), Kernels)
    assert not isinstance(object(), Kernels)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_kernels_low_precision_activations(tk: TorchKernels, device: str) -> None:
    """On CUDA the model runs activations in the weight dtype: the fallback must too."""
    dt = torch.bfloat16
    x = randn(3, 64, seed=1).to(device, dt)
    w = tk.pack_linear_weight(randn(24, 64, seed=2).to(device, dt))
    y = tk.linear(x, w, randn(24, seed=3).to(device, dt))
    assert y.dtype == dt and y.shape == (3, 24)
    norm_w = randn(64, seed=4).to(device, dt)
    assert tk.rms_norm(x, norm_w, 1e-6).dtype == dt
    normed, res = x.clone(), randn(3, 64, seed=5).to(device, dt)
    want_res = res + x
    tk.fused_add_rms_norm(normed, res, norm_w, 1e-6)
    assert torch.equal(res, want_res)  # residual += x, in the activations' dtype
    assert normed.dtype == dt and torch.equal(normed, tk.rms_norm(want_res, norm_w, 1e-6))
    assert tk.silu_and_mul(x).shape == (3, 32)
    case = make_attn_case([20, 5], [2, 1], 4, 2, 16, dt)
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in case.args()]
    args[0] = args[0].to(dt)
    out = tk.paged_attention(*args)
    assert out.dtype == dt
    torch.testing.assert_close(out.cpu().double(), attention_f64(case), rtol=0.05, atol=0.05)
