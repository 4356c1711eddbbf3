"""GGUF-quantized linear weights: the native kernel (quant_linear.cpp) against its exact
reference, the fp32 linear over quant.dequantize (bitwise), for every type and odd shapes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from laneserve.kernels import CpuKernels, quant
from laneserve.kernels.quant import GGUF_BLOCKS, QuantWeight


def random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> QuantWeight:
    """Random GGUF blocks: random quant bytes, finite fp16 scales (and offsets)."""
    g = torch.Generator().manual_seed(seed)
    block, nbytes = GGUF_BLOCKS[qtype]
    raw = torch.randint(0, 256, (n * (k // block), nbytes), generator=g, dtype=torch.uint8)
    scales = 2 if qtype == "q4_k" else (2 if qtype == "q4_1" else 1)
    for i in range(scales):  # d (and m / dmin) as fp16 in [-0.05, 0.05]
        v = ((torch.rand(raw.shape[0], generator=g) - 0.5) * 0.1).to(torch.float16)
        raw[:, 2 * i : 2 * i + 2] = v.view(torch.uint8).view(-1, 2)
    return QuantWeight(raw.view(n, -1), qtype, k)


@pytest.mark.parametrize("qtype", quant.QTYPES)
def test_dequantize_matches_gguf_package(qtype: str) -> None:
    gguf = pytest.importorskip("gguf")
    k = 512
    qw = random_blocks(qtype, 19, k, seed=1)
    kind = getattr(gguf.GGMLQuantizationType, qtype.upper())
    want = gguf.quants.dequantize(qw.data.numpy(), kind)
    got = quant.dequantize(qw).numpy()
    np.testing.assert_array_equal(got, np.asarray(want, dtype=np.float32).reshape(19, k))


def test_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError):
        QuantWeight(torch.zeros(4, 20, dtype=torch.uint8), "q4_1", 64)  # 64 needs 40 bytes
    with pytest.raises(ValueError):
        QuantWeight(torch.zeros(4, 20, dtype=torch.uint8), "q4_1", 33)
    with pytest.raises(ValueError):
        QuantWeight(torch.zeros(4, 20, dtype=torch.uint8), "q5_0", 32)


def test_cat_rows_concatenates_blocks() -> None:
    a, b = random_blocks("q4_1", 5, 64, 1), random_blocks("q4_1", 3, 64, 2)
    cat = quant.cat_rows([a, b])
    assert isinstance(cat, QuantWeight) and cat.shape == (8, 64)
    torch.testing.assert_close(
        quant.dequantize(cat), torch.cat([quant.dequantize(a), quant.dequantize(b)]), rtol=0, atol=0
    )
    mixed = quant.cat_rows([a, torch.ones(2, 64)])
    assert isinstance(mixed, torch.Tensor) and mixed.shape == (7, 64)


@pytest.fixture(params=["avx512", "avx2"])
def cpu_kernels(ck: CpuKernels, request: pytest.FixtureRequest) -> CpuKernels:
    """The native kernel in both variants (AVX-512 where the CPU has it, and AVX2)."""
    if request.param == "avx512" and ck.isa != "avx512":
        pytest.skip("this CPU has no AVX-512")
    return CpuKernels(dataclasses.replace(ck.lib, isa=request.param))


SHAPES = [
    (1, 7, 32),
    (1, 31, 64),  # 2 column blocks, the second partial (a 1-row tile of 4 blocks falls back)
    (2, 65, 96),  # 5 blocks: a 2-row tile of 2 blocks twice, then one
    (3, 33, 96),
    (6, 16, 256),
    (7, 50, 512),
    (13, 129, 768),
    (1, 576, 1536),
    (1, 4100, 576),  # wide N: split over threads (the LM head's shape, smaller)
]


@pytest.mark.parametrize("qtype", quant.QTYPES)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_native_equals_dequantized_fp32(
    cpu_kernels: CpuKernels, qtype: str, m: int, n: int, k: int
) -> None:
    if k % GGUF_BLOCKS[qtype][0]:
        pytest.skip("K is not a multiple of the block")
    qw = random_blocks(qtype, n, k, seed=m * 1000 + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    bias = torch.randn(n) if n % 2 else None
    native = cpu_kernels.pack_gguf_weight(qw)
    assert native.dtype is torch.uint8 and native.layout == f"gguf-{qtype}-{cpu_kernels.isa}"
    ref = cpu_kernels.pack_linear_weight(quant.dequantize(qw))
    got = cpu_kernels.linear(x, native, bias)
    want = cpu_kernels.linear(x, ref, bias)
    assert torch.equal(got, want)
    # and close to torch's own matmul over the same weights (fp32 rounding bound)
    w = quant.dequantize(qw)
    ref_mm = torch.nn.functional.linear(x, w, bias)
    bound = 1e-5 * (x.abs() @ w.abs().T + (0 if bias is None else bias.abs())) + 1e-6
    assert bool(((got - ref_mm).abs() <= bound).all())


@pytest.mark.parametrize("qtype", quant.QTYPES)
def test_native_is_batch_invariant(cpu_kernels: CpuKernels, qtype: str) -> None:
    qw = random_blocks(qtype, 40, 256, seed=3)
    w = cpu_kernels.pack_gguf_weight(qw)
    x = torch.randn(11, 256)
    full = cpu_kernels.linear(x, w)
    for i in (0, 5, 10):
        assert torch.equal(cpu_kernels.linear(x[i : i + 1], w), full[i : i + 1])


def test_native_variants_agree_on_special_values(ck: CpuKernels) -> None:
    """Both variants against the fp32 path where the activations hold inf, nan, -0.0 and
    denormals (the FMA chain order decides which nan / inf comes out)."""
    qw = random_blocks("q4_1", 37, 128, seed=5)
    x = torch.randn(5, 128)
    x[0, 3], x[1, 7], x[2, 0], x[3, 64] = float("inf"), float("nan"), -0.0, 1e-42
    isas = ["avx2", "avx512"] if ck.isa == "avx512" else ["avx2"]
    for isa in isas:
        k = CpuKernels(dataclasses.replace(ck.lib, isa=isa))
        got = k.linear(x, k.pack_gguf_weight(qw))
        want = k.linear(x, k.pack_linear_weight(quant.dequantize(qw)))
        assert torch.equal(got.nan_to_num(1.0, 2.0, 3.0), want.nan_to_num(1.0, 2.0, 3.0)), isa
        assert torch.equal(got.isnan(), want.isnan())


EXTREME_FP16 = [65504.0, -65504.0, 2.0**-24, -(2.0**-24), 0.0, -0.0, 6.1e-5, 1.0, -3.5]


@pytest.mark.parametrize("qtype", quant.QTYPES)
def test_native_exact_at_extreme_scales(ck: CpuKernels, qtype: str) -> None:
    """Scales and offsets at fp16's extremes (max, subnormal, signed zeros): the AVX2
    variant rebuilds a weight with one fma(q, s, o), which must round like the reference's
    mul then add (quant_linear_avx2.cpp NOTE); also the AVX-512 one where the CPU has it."""
    qw = random_blocks(qtype, 45, 256, seed=7)
    nbytes = GGUF_BLOCKS[qtype][1]
    raw = qw.data.view(-1, nbytes).clone()
    fields = 2 if qtype in ("q4_1", "q4_k") else 1
    values = torch.tensor(EXTREME_FP16, dtype=torch.float16)
    for f in range(fields):
        picks = values[torch.arange(raw.shape[0]) * (f + 2) % len(EXTREME_FP16)]
        raw[:, 2 * f : 2 * f + 2] = picks.view(torch.uint8).view(-1, 2)
    qw = QuantWeight(raw.view(45, -1), qtype, 256)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2)) * 1e-3
    isas = ["avx2", "avx512"] if ck.isa == "avx512" else ["avx2"]
    for isa in isas:
        k = CpuKernels(dataclasses.replace(ck.lib, isa=isa))
        got = k.linear(x, k.pack_gguf_weight(qw))
        want = k.linear(x, k.pack_linear_weight(quant.dequantize(qw)))
        assert torch.equal(got, want), isa
        assert torch.equal(got.signbit(), want.signbit()), isa


def test_torch_kernels_take_gguf_weights() -> None:
    from laneserve.kernels import TorchKernels

    tk = TorchKernels()
    qw = random_blocks("q4_0", 9, 64)
    x = torch.randn(2, 64)
    got = tk.linear(x, tk.pack_gguf_weight(qw))
    assert torch.equal(got, torch.nn.functional.linear(x, quant.dequantize(qw)))
