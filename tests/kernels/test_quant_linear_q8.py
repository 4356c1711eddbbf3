"""GGUF weights times int8 activations (`--gguf-weights q8-dot`): the VNNI kernel
(quant_linear_q8.cpp) against its exact torch reference (q8.py) bit for bit, for every type
and odd shapes; the activation quantizer; row invariance; special groups; bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from laneserve.kernels import CpuKernels, TorchKernels, q8, quant
from laneserve.kernels.quant import GGUF_BLOCKS, QuantWeight
from tests.kernels.test_quant_linear import random_blocks


def q8_blocks(qtype: str, n: int, k: int, seed: int = 0) -> QuantWeight:
    return dataclasses.replace(random_blocks(qtype, n, k, seed), activations="q8")


@pytest.fixture
def vnni(ck: CpuKernels) -> CpuKernels:
    if not ck.vnni:
        pytest.skip("this CPU has no AVX-512 VNNI")
    return ck


SHAPES = [(1, 7, 32), (3, 33, 96), (6, 16, 256), (7, 50, 512), (13, 129, 768), (1, 576, 1536)]


@pytest.mark.parametrize("qtype", quant.QTYPES)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_vnni_equals_reference(
    vnni: CpuKernels, tk: TorchKernels, qtype: str, m: int, n: int, k: int
) -> None:
    if k % GGUF_BLOCKS[qtype][0]:
        pytest.skip("K is not a multiple of the block")
    qw = q8_blocks(qtype, n, k, seed=m * 1000 + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n)) * 3
    bias = torch.randn(n) if n % 2 else None
    packed = vnni.pack_gguf_weight(qw)
    assert packed.layout == f"gguf-{qtype}-q8-vnni"
    assert packed.data.shape[-1] == q8.record_bytes(qtype)
    got = vnni.linear(x, packed, bias)
    want = tk.linear(x, tk.pack_gguf_weight(qw), bias)
    assert torch.equal(got, want)
    # the int8 activations cost about 1 % of each dot product's magnitude, never more than 2 %
    w = quant.dequantize(qw)
    exact = torch.nn.functional.linear(
        x.double(), w.double(), None if bias is None else bias.double()
    )
    scale = x.abs().double() @ w.abs().double().T + 1e-6
    assert bool(((got.double() - exact).abs() <= 0.02 * scale).all())


def test_activation_quantizer_matches_reference(vnni: CpuKernels) -> None:
    x = torch.randn(9, 256) * torch.logspace(-3, 3, 9)[:, None]
    x[0, :32] = 0.0  # a zero group
    x[1, 32:64] = 1e-32  # below the tiny threshold: zero too
    x[2, 5] = float("nan")
    x[3, 70] = float("inf")
    x[4, :32] = torch.arange(32) - 15.5  # ties at the rounding points
    got = vnni.lib.ops.quantize_q8(x)
    want = q8.quantize_rows(x)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    q, dx, sx, sq = want
    assert int(q.abs().max()) == 127 and int(q[0, :32].abs().sum()) == 0
    assert float(dx[1, 1]) == 0.0 and bool(dx[2, 0].isnan()) and bool(dx[3, 2].isnan())
    assert torch.equal(sq, q.view(9, 8, 32).int().sum(-1))
    assert torch.equal(sx.nan_to_num(7.0), (dx * sq.float()).nan_to_num(7.0))


def test_special_groups_reach_the_output(vnni: CpuKernels, tk: TorchKernels) -> None:
    """A NaN or inf activation makes its row NaN (as an fp32 matmul would make it non-finite);
    a zero row gives the bias; other rows are untouched."""
    qw = q8_blocks("q4_1", 20, 128, seed=5)
    x = torch.randn(4, 128)
    x[1, 3] = float("nan")
    x[2, 100] = float("-inf")
    x[3] = 0.0
    bias = torch.randn(20)
    got = vnni.linear(x, vnni.pack_gguf_weight(qw), bias)
    assert bool(got[1].isnan().all()) and bool(got[2].isnan().all())
    assert torch.equal(got[3], bias)
    clean = vnni.linear(x[:1], vnni.pack_gguf_weight(qw), bias)
    assert torch.equal(got[:1], clean)
    assert torch.equal(
        got.nan_to_num(1.0), tk.linear(x, tk.pack_gguf_weight(qw), bias).nan_to_num(1.0)
    )


@pytest.mark.parametrize("qtype", quant.QTYPES)
def test_rows_are_invariant_to_batch_and_threads(vnni: CpuKernels, qtype: str) -> None:
    qw = q8_blocks(qtype, 200, 256, seed=3)
    w = vnni.pack_gguf_weight(qw)
    x = torch.randn(37, 256)
    full = vnni.linear(x, w)
    for i in (0, 5, 36):
        assert torch.equal(vnni.linear(x[i : i + 1], w), full[i : i + 1])
    assert torch.equal(vnni.linear(x[7:20], w), full[7:20])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(vnni.linear(x, w), full)
    finally:
        torch.set_num_threads(threads)


def test_cpu_without_vnni_takes_the_reference(ck: CpuKernels, tk: TorchKernels) -> None:
    plain = CpuKernels(dataclasses.replace(ck.lib, vnni=False))
    qw = q8_blocks("q4_k", 24, 256, seed=2)
    packed = plain.pack_gguf_weight(qw)
    assert packed.layout.endswith(q8.TORCH_LAYOUT_SUFFIX)
    x = torch.randn(3, 256)
    assert torch.equal(plain.linear(x, packed), tk.linear(x, tk.pack_gguf_weight(qw)))


def test_fp32_and_q8_weights_differ_only_in_arithmetic(tk: TorchKernels) -> None:
    """The default activations stay fp32 (the exact dequantized path); q8 is opt-in."""
    qw = random_blocks("q4_0", 16, 64, seed=9)
    assert qw.activations == "fp32"
    x = torch.randn(2, 64)
    fp32 = tk.linear(x, tk.pack_gguf_weight(qw))
    assert torch.equal(fp32, torch.nn.functional.linear(x, quant.dequantize(qw)))
    int8 = tk.linear(x, tk.pack_gguf_weight(dataclasses.replace(qw, activations="q8")))
    assert not torch.equal(int8, fp32)
    torch.testing.assert_close(int8, fp32, rtol=0.05, atol=0.05)


def test_bad_input_is_refused(vnni: CpuKernels) -> None:
    with pytest.raises(ValueError, match="activations"):
        QuantWeight(torch.zeros(4, 20, dtype=torch.uint8), "q4_1", 32, "int4")
    w = vnni.pack_gguf_weight(q8_blocks("q4_1", 16, 64))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        vnni.lib.ops.quant_linear_q8(torch.randn(2, 48), w.data, 16, 1, None)
    with pytest.raises(RuntimeError, match="does not match"):
        vnni.lib.ops.quant_linear_q8(torch.randn(2, 96), w.data, 16, 1, None)
    with pytest.raises(RuntimeError, match="float32"):
        vnni.lib.ops.quant_linear_q8(torch.randn(2, 64).double(), w.data, 16, 1, None)
    with pytest.raises(RuntimeError, match="qtype"):
        vnni.lib.ops.quant_linear_q8(torch.randn(2, 64), w.data, 16, 7, None)


def test_cat_rows_keeps_the_activations() -> None:
    a, b = q8_blocks("q4_1", 5, 64, 1), q8_blocks("q4_1", 3, 64, 2)
    cat = quant.cat_rows([a, b])
    assert isinstance(cat, QuantWeight) and cat.activations == "q8" and cat.shape == (8, 64)
    mixed = quant.cat_rows([a, random_blocks("q4_1", 3, 64, 2)])
    assert isinstance(mixed, torch.Tensor)  # mixed arithmetic: dequantized, fp32
