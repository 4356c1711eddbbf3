"""hyper_pre / hyper_post (DeepSeek V4's hyper-connections): the C++ ops against the
torch reference and against a float64 computation of the formulas."""

from __future__ import annotations

import pytest
import torch

from laneserve.kernels import CpuKernels, TorchKernels
from tests.kernels.helpers import randn

N, ITERS, EPS, RMS_EPS = 4, 20, 1e-6, 1e-6


def weights(h: int, n: int = N) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m = (2 + n) * n
    return randn(m, n * h, seed=11, scale=0.05), randn(m, seed=12), randn(3, seed=13) + 1.0


def pre_f64(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor):
    """The formulas in float64, Sinkhorn as a fixed number of rounds."""
    t, n = streams.shape[:2]
    x = streams.double().reshape(t, -1)
    mix = (x / x.square().mean(-1, keepdim=True).add(RMS_EPS).sqrt()) @ fn.double().T
    b, s = base.double(), scale.double()
    pre = torch.sigmoid(mix[:, :n] * s[0] + b[:n]) + EPS
    post = 2 * torch.sigmoid(mix[:, n : 2 * n] * s[1] + b[n : 2 * n])
    comb = torch.softmax(mix[:, 2 * n :].view(t, n, n) * s[2] + b[2 * n :].view(n, n), -1) + EPS
    comb = comb / (comb.sum(-2, keepdim=True) + EPS)
    for _ in range(ITERS - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + EPS)
        comb = comb / (comb.sum(-2, keepdim=True) + EPS)
    return post, comb, (pre[..., None] * streams.double()).sum(1)


@pytest.mark.parametrize("h", [64, 1024])
@pytest.mark.parametrize("t", [1, 5, 40])
def test_hyper_pre_matches_reference_and_f64(
    ck: CpuKernels, tk: TorchKernels, h: int, t: int
) -> None:
    fn, base, scale = weights(h)
    streams = randn(t, N, h, seed=t, scale=3.0)
    got = ck.hyper_pre(streams, fn, base, scale, ITERS, EPS, RMS_EPS)
    ref = tk.hyper_pre(streams, fn, base, scale, ITERS, EPS, RMS_EPS)
    exact = pre_f64(streams, fn, base, scale)
    for g, r, e in zip(got, ref, exact, strict=True):
        assert g.dtype == r.dtype == torch.float32 and g.shape == r.shape
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g.double(), e, rtol=1e-5, atol=1e-5)
    post, comb, _ = got
    assert ((post > 0) & (post < 2)).all()
    # columns sum to 1: Sinkhorn's last normalisation
    torch.testing.assert_close(comb.sum(-2), torch.ones(t, N), rtol=0, atol=1e-5)


def test_hyper_pre_is_per_token(ck: CpuKernels) -> None:
    fn, base, scale = weights(64)
    streams = randn(33, N, 64, seed=3)
    whole = ck.hyper_pre(streams, fn, base, scale, ITERS, EPS, RMS_EPS)
    for i in (0, 17, 32):
        one = ck.hyper_pre(streams[i : i + 1], fn, base, scale, ITERS, EPS, RMS_EPS)
        for a, b in zip(whole, one, strict=True):
            assert torch.equal(a[i : i + 1], b)


@pytest.mark.parametrize(
    ("sdt", "odt", "want"),
    [
        (torch.float32, torch.float32, torch.float32),
        (torch.bfloat16, torch.float32, torch.float32),
        (torch.float32, torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    ],
)
def test_hyper_post_dtypes(
    ck: CpuKernels, tk: TorchKernels, sdt: torch.dtype, odt: torch.dtype, want: torch.dtype
) -> None:
    t, h = 7, 64
    streams, out = randn(t, N, h, seed=1).to(sdt), randn(t, h, seed=2).to(odt)
    post, comb, _ = ck.hyper_pre(streams, *weights(h), ITERS, EPS, RMS_EPS)
    got = ck.hyper_post(streams, out, post, comb)
    ref = tk.hyper_post(streams, out, post, comb)
    assert got.dtype == ref.dtype == want and got.shape == (t, N, h)
    exact = post.double()[..., None] * out.double()[:, None] + torch.einsum(
        "tjn,tjh->tnh", comb.double(), streams.double()
    )
    tol = 1e-5 if want == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), exact, rtol=tol, atol=tol)
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


def test_hyper_bf16_streams_collapse_in_their_dtype(ck: CpuKernels, tk: TorchKernels) -> None:
    fn, base, scale = weights(64)
    streams = randn(3, N, 64, seed=5).to(torch.bfloat16)
    _, _, got = ck.hyper_pre(streams, fn, base, scale, ITERS, EPS, RMS_EPS)
    _, _, ref = tk.hyper_pre(streams, fn, base, scale, ITERS, EPS, RMS_EPS)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref.float(), rtol=1e-2, atol=1e-2)


def test_hyper_odd_width_takes_the_reference(ck: CpuKernels, tk: TorchKernels) -> None:
    fn, base, scale = weights(12)
    streams = randn(2, N, 12, seed=6)
    got = ck.hyper_pre(streams, fn, base, scale, ITERS, EPS, RMS_EPS)
    ref = tk.hyper_pre(streams, fn, base, scale, ITERS, EPS, RMS_EPS)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)


def test_hyper_ops_refuse_bad_shapes(ck: CpuKernels) -> None:
    fn, base, scale = weights(64)
    with pytest.raises(RuntimeError, match="fn"):
        ck.lib.ops.hyper_pre(randn(2, N, 64, seed=1), fn[:-1], base, scale, 3, EPS, RMS_EPS)
    with pytest.raises(RuntimeError, match="out"):
        post, comb = torch.ones(2, N), torch.ones(2, N, N)
        ck.lib.ops.hyper_post(randn(2, N, 64, seed=1), randn(2, 32, seed=2), post, comb)
