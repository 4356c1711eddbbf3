"""rms_norm, fused_add_rms_norm, rotary_embedding and silu_and_mul (TorchKernels also
on CUDA when it is available)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from laneserve.kernels import CpuKernels, TorchKernels
from tests.kernels.helpers import DEVICES, randn

# ----------------------------------------------------------------------------- norms


def rms_norm_hf(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return w * (x * torch.rsqrt(variance + eps))


def rms_norm_f64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    return w.double() * xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("h", [576, 72, 13])
def test_rms_norm(ck: CpuKernels, tk: TorchKernels, h: int) -> None:
    eps = 1e-5
    w = randn(h, seed=1) + 1.0
    for m in (1, 3, 33):
        x = randn(m, h, seed=m, scale=4.0)
        y = ck.rms_norm(x, w, eps)
        torch.testing.assert_close(y, rms_norm_hf(x, w, eps), rtol=2e-6, atol=1e-6)
        torch.testing.assert_close(y.double(), rms_norm_f64(x, w, eps), rtol=2e-6, atol=1e-6)
        torch.testing.assert_close(tk.rms_norm(x, w, eps), rms_norm_hf(x, w, eps), rtol=0, atol=0)


def test_rms_norm_batch_invariance(ck: CpuKernels) -> None:
    w = randn(576, seed=1)
    x = randn(17, 576, seed=2)
    out = ck.rms_norm(x, w, 1e-6)
    for r in range(17):
        assert torch.equal(out[r], ck.rms_norm(x[r : r + 1], w, 1e-6)[0])


@pytest.mark.parametrize("h", [576, 13])
def test_fused_add_rms_norm(ck: CpuKernels, tk: TorchKernels, h: int) -> None:
    eps = 1e-6
    w = randn(h, seed=1)
    x0 = randn(9, h, seed=2)
    r0 = randn(9, h, seed=3, scale=10.0)
    x, r = x0.clone(), r0.clone()
    ck.fused_add_rms_norm(x, r, w, eps)
    assert torch.equal(r, r0 + x0)
    torch.testing.assert_close(x, rms_norm_hf(r0 + x0, w, eps), rtol=2e-6, atol=1e-6)
    xt, rt = x0.clone(), r0.clone()
    tk.fused_add_rms_norm(xt, rt, w, eps)
    assert torch.equal(rt, r) and torch.equal(xt, rms_norm_hf(r0 + x0, w, eps))
    # Batch invariance: each row alone gives the same bits.
    for i in (0, 4, 8):
        xi, ri = x0[i : i + 1].clone(), r0[i : i + 1].clone()
        ck.fused_add_rms_norm(xi, ri, w, eps)
        assert torch.equal(xi[0], x[i]) and torch.equal(ri[0], r[i])


# ----------------------------------------------------------------------------- rotary


def cos_sin_cache(max_pos: int, d: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def rotary_hf(x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, d: int):
    """HF apply_rotary_pos_emb (rotate_half) on [T, H*D]."""
    half = d // 2
    cos = cache[positions, :half].repeat(1, 2)[:, None, :]
    sin = cache[positions, half:].repeat(1, 2)[:, None, :]
    xh = x.reshape(x.shape[0], -1, d)
    rot = torch.cat([-xh[..., half:], xh[..., :half]], dim=-1)
    return (xh * cos + rot * sin).reshape(x.shape)


@pytest.mark.parametrize("d", [64, 6, 32])
@pytest.mark.parametrize("device", DEVICES)
def test_rotary_embedding(ck: CpuKernels, tk: TorchKernels, d: int, device: str) -> None:
    hq, hk, t = 9, 3, 7
    cache = cos_sin_cache(4096, d)
    positions = torch.tensor([0, 1, 5, 17, 139, 1000, 4095])
    qkv = randn(t, (hq + 2 * hk) * d, seed=d)
    expect_q = rotary_hf(qkv[:, : hq * d], positions, cache, d)
    expect_k = rotary_hf(qkv[:, hq * d : (hq + hk) * d], positions, cache, d)
    impls = [tk] if device != "cpu" else [ck, tk]
    for impl in impls:
        fused = qkv.clone().to(device)
        # Column slices of the fused qkv output: row stride != width.
        q = fused[:, : hq * d]
        k = fused[:, hq * d : (hq + hk) * d]
        impl.rotary_embedding(positions.to(device), q, k, d, cache.to(device))
        # NOTE: same unfused fp32 formula as HF, so the results are bitwise equal.
        assert torch.equal(q.cpu(), expect_q), type(impl).__name__
        assert torch.equal(k.cpu(), expect_k), type(impl).__name__
        assert torch.equal(fused[:, (hq + hk) * d :].cpu(), qkv[:, (hq + hk) * d :])  # v intact


def test_rotary_3d_contiguous(ck: CpuKernels) -> None:
    d, cache = 64, cos_sin_cache(256, 64)
    positions = torch.arange(5) * 7
    q = randn(5, 4, d, seed=1)
    k = randn(5, 2, d, seed=2)
    q2, k2 = q.clone().view(5, -1), k.clone().view(5, -1)
    ck.rotary_embedding(positions, q, k, d, cache)
    ck.rotary_embedding(positions, q2, k2, d, cache)
    assert torch.equal(q.view(5, -1), q2) and torch.equal(k.view(5, -1), k2)


# ----------------------------------------------------------------------------- silu


@pytest.mark.parametrize("i", [1536, 13])
def test_silu_and_mul(ck: CpuKernels, tk: TorchKernels, i: int) -> None:
    x = randn(7, 2 * i, seed=i, scale=6.0)
    x[0, :8] = torch.tensor([0.0, -0.0, 100.0, -100.0, -87.0, -89.0, 88.5, -1e-30])
    y = ck.silu_and_mul(x)
    ref = F.silu(x[:, :i].double()) * x[:, i:].double()
    torch.testing.assert_close(y.double(), ref, rtol=2e-6, atol=1e-30)
    torch.testing.assert_close(y, tk.silu_and_mul(x), rtol=2e-6, atol=1e-30)
    for r in range(7):  # row-wise invariance
        assert torch.equal(y[r], ck.silu_and_mul(x[r : r + 1])[0])


@pytest.mark.parametrize("i", [512, 13])
def test_silu_and_mul_with_limit(ck: CpuKernels, tk: TorchKernels, i: int) -> None:
    """DeepSeek V4's clamped SwiGLU: the gate clamped from above, the up half both ways;
    a NaN comes through as torch's clamp lets it."""
    limit = 0.6
    x = randn(5, 2 * i, seed=i, scale=3.0)
    x[0, :3] = torch.tensor([float("nan"), 0.7, -5.0])
    x[0, i : i + 3] = torch.tensor([1.0, float("nan"), -5.0])
    y = ck.silu_and_mul(x, limit)
    gate, up = x[:, :i].double(), x[:, i:].double()
    ref = F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
    torch.testing.assert_close(y.double(), ref, rtol=2e-6, atol=1e-30, equal_nan=True)
    torch.testing.assert_close(y, tk.silu_and_mul(x, limit), rtol=2e-6, atol=1e-30, equal_nan=True)
    assert y[0, :2].isnan().all() and not y[0, 2:].isnan().any()
    assert not torch.equal(y[1:], ck.silu_and_mul(x)[1:])  # the limit did apply
