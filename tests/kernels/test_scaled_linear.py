"""Block-scaled FP8 / MXFP4 weights kept as stored (scaled.py, scaled_linear.cpp): the
dequantizer equals the load-time one, the kernel (AVX-512 variant where the CPU has it,
and AVX2) is bitwise the fp32 linear kernel on the dequantized weight (its FMA chain is
the same) for shapes that do not divide the blocks, batch invariant; the torch reference
agrees within fp32 summation-order noise."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from laneserve.kernels import CpuKernels, TorchKernels, load_kernels, scaled
from laneserve.kernels import build as kbuild
from laneserve.kernels.scaled import ScaledWeight
from laneserve.model.layers import fp8


def random_fp8(n: int, k: int, block: tuple[int, int], seed: int) -> ScaledWeight:
    """Every e4m3 byte but NaN (subnormals and -0 included), V3-style fp32 block scales."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x3C
    grid = (-(-n // block[0]), -(-k // block[1]))
    s = torch.rand(grid, generator=g) * 2.0 ** torch.randint(-12, -4, grid, generator=g).float()
    return scaled.from_fp8_blocks(raw.view(torch.float8_e4m3fn), s, block)


def random_fp4(n: int, k: int, seed: int) -> ScaledWeight:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, -(-k // 2)), generator=g, dtype=torch.uint8)
    exps = torch.randint(110, 135, (n, -(-k // 32)), generator=g, dtype=torch.uint8)
    return scaled.from_fp4_packed(raw.view(torch.int8), exps.view(torch.float8_e8m0fnu), k)


def make(fmt: str, n: int, k: int, seed: int) -> ScaledWeight:
    if fmt == "fp4":
        return random_fp4(n, k, seed)
    block = (128, 128) if seed % 2 else (16, 48)  # V3 / V4's 128 x 128, and another grid
    return random_fp8(n, k, block, seed)


# (M, N, K): N and K off the 16 / 32 / 128 blocks, odd K for fp4's last half byte; the
# AVX-512 variant's tiles: 1-8 rows decoded in registers (15 and 13 column blocks: tiles of
# 8 / 4 / 2 / 1), more rows through its decoded buffer (12-row tiles and a remainder, K
# past its 128-k chunk, an odd block count)
SHAPES = [
    (1, 7, 33),
    (3, 129, 200),
    (5, 40, 64),
    (6, 16, 257),
    (13, 150, 130),
    (2, 300, 1000),
    (1, 240, 301),
    (4, 200, 96),
    (8, 90, 160),
    (9, 33, 129),
    (30, 70, 333),
]


VARIANTS = ["avx512-vbmi", "avx512", "avx2"]


def kernels_for(ck: CpuKernels, name: str) -> CpuKernels:
    """The kernels with scaled_linear's variant `name` (VARIANTS); skips where the CPU
    lacks it."""
    if name != "avx2" and ck.isa != "avx512":
        pytest.skip("this CPU has no AVX-512")
    if name == "avx512-vbmi" and not ck.lib.vbmi:
        pytest.skip("this CPU has no AVX-512 VBMI")
    isa = "avx2" if name == "avx2" else "avx512"
    kernels = CpuKernels(dataclasses.replace(ck.lib, isa=isa, vbmi=name == "avx512-vbmi"))
    assert kernels.scaled_isa == VARIANTS[::-1].index(name)  # the op's isa code
    return kernels


@pytest.fixture(params=VARIANTS)
def variant(ck: CpuKernels, request: pytest.FixtureRequest) -> CpuKernels:
    """The native kernel in each variant the CPU has: AVX-512 decoding fp8 by VBMI
    permutes, AVX-512 F + BW, AVX2."""
    return kernels_for(ck, request.param)


def test_dequantize_equals_the_load_time_dequantizers() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=g) * 0.05
    q, s = fp8.quantize(w, (128, 128))
    got = scaled.dequantize(scaled.from_fp8_blocks(q, s, (128, 128)))
    assert torch.equal(got, fp8.dequantize(q, s, (128, 128)))
    for fp4 in (False, True):
        q, s = fp8.quantize_ue8m0(w, fp4)
        sw = scaled.from_fp4_packed(q, s, 300) if fp4 else scaled.from_fp8_blocks(q, s, (128, 128))
        assert torch.equal(scaled.dequantize(sw), fp8.dequantize_scaled(q, s))
        assert scaled.dequantize_rows(sw, 130, 200).equal(scaled.dequantize(sw)[130:200])


def test_fp4_nibble_order_and_values() -> None:
    """Low nibble = even column (DeepSeek's unpack: `u & 0x0F` first, then `u >> 4`)."""
    data = torch.tensor([[0x1F, 0x80 | 0x07]], dtype=torch.uint8)  # codes 15, 1, 0, 8
    scale = torch.tensor([[128]], dtype=torch.uint8)  # 2 ** 1
    w = ScaledWeight(data, scale, "fp4", 3, 32)
    got = scaled.dequantize(w)
    assert got.tolist() == [[-12.0, 1.0, 12.0]]


@pytest.mark.parametrize("fmt", scaled.FORMATS)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_cpu_kernel_bitwise_the_fp32_kernel_on_dequantized(
    ck: CpuKernels, variant: CpuKernels, fmt: str, m: int, n: int, k: int
) -> None:
    w = make(fmt, n, k, seed=m * 7 + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    bias = torch.randn(n) if n % 2 else None
    packed = variant.pack_scaled_weight(w)
    assert packed.layout == f"scaled-{fmt}-blocked16" and packed.dtype == torch.uint8
    got = variant.linear(x, packed, bias)
    want = ck.linear(x, ck.pack_linear_weight(scaled.dequantize(w)), bias)
    assert torch.equal(got, want)
    rows = [variant.linear(x[i : i + 1], packed, bias) for i in range(m)]  # batch invariant
    assert torch.equal(torch.cat(rows), got)
    # the prompt-row argument takes the same path (no other numerics for these weights)
    assert torch.equal(variant.linear(x, packed, bias, first_prefill=0), got)


@pytest.mark.parametrize("fmt", scaled.FORMATS)
@pytest.mark.parametrize("name", VARIANTS[:2])
def test_avx512_variants_give_the_avx2_bits(ck: CpuKernels, fmt: str, name: str) -> None:
    """An AVX-512 variant and the AVX2 one side by side on one packed weight, every row
    count from 1 to 26 (both AVX-512 tilings), with and without bias, -0.0 included."""
    fast, avx2 = kernels_for(ck, name), kernels_for(ck, "avx2")
    w = make(fmt, 100, 291, seed=4)
    packed = fast.pack_scaled_weight(w)
    x = torch.randn(26, 291, generator=torch.Generator().manual_seed(2))
    x[:, :4] = 0.0
    for bias in (None, torch.randn(100)):
        for m in range(1, 27):
            got, want = fast.linear(x[:m], packed, bias), avx2.linear(x[:m], packed, bias)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (m, bias is None)


def test_avx512_variant_is_engaged_here(ck: CpuKernels, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the CPU has AVX-512 F + BW (+ VBMI), the kernels as loaded pick the AVX-512
    variant (decoding fp8 by VBMI permutes) and pass it to the op on every call; the op
    refuses an unknown variant."""
    flags = kbuild.cpu_flags() or set()
    if not flags >= kbuild.AVX512_CPU_FLAGS:
        pytest.skip("this CPU has no AVX-512")
    monkeypatch.delenv(kbuild.ISA_ENV, raising=False)
    lib = load_kernels()
    assert lib is not None and lib.isa == "avx512"
    assert lib.vbmi == (kbuild.VBMI_CPU_FLAG in flags)
    kernels = CpuKernels(lib)
    seen: list[Any] = []
    op = kernels._scaled_linear

    def spy(*args: Any) -> torch.Tensor:
        seen.append(args[-1])
        return op(*args)

    monkeypatch.setattr(kernels, "_scaled_linear", spy)
    for fmt in scaled.FORMATS:
        packed = kernels.pack_scaled_weight(make(fmt, 20, 64, 1))
        kernels.linear(torch.randn(1, 64), packed)  # a decode row
        kernels.linear(torch.randn(9, 64), packed, first_prefill=0)  # prompt rows
    code = 2 if lib.vbmi else 1  # the op's AVX-512 codes (VARIANTS)
    assert seen == [code] * 4
    with pytest.raises(RuntimeError, match="unknown isa"):
        op(torch.randn(1, 64), packed.data, packed.scale, 20, 1, 32, None, 3)


def test_cpu_kernel_bitwise_at_extreme_scales(ck: CpuKernels, variant: CpuKernels) -> None:
    """Scales at the ends of their ranges: ue8m0 bytes 0 (2^-127, subnormal) to 200, and
    fp8 block scales past 2^119 (where the kernel cannot fold its 2^8 into the scale) or
    subnormal, beside ordinary ones: still bitwise the fp32 kernel on the dequantized
    weight, every output finite."""
    g = torch.Generator().manual_seed(5)
    n, k = 40, 96
    x = torch.randn(3, k, generator=g)
    raw = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    exps = torch.randint(0, 201, (n, k // 32), generator=g, dtype=torch.uint8)
    exps[:3] = 0
    fp4 = scaled.from_fp4_packed(raw, exps, k)
    # fp8 bytes up to 2^-5 (exponent field <= 2), so 2^125 scales stay finite
    small = torch.randint(0, 0x18, (n, k), generator=g, dtype=torch.uint8)
    small |= torch.randint(0, 2, (n, k), generator=g, dtype=torch.uint8) << 7
    grid = torch.tensor([[2.0**125, 0.75], [2.0**-140, 3.0], [1e-3, 2.0**121]])
    fp8w = scaled.from_fp8_blocks(small.view(torch.float8_e4m3fn), grid, (16, 64))
    for w, rows in ((fp4, 3), (fp8w, 3), (fp4, 11), (fp8w, 11)):  # both AVX-512 tilings
        xs = x.repeat(4, 1)[:rows]
        got = variant.linear(xs, variant.pack_scaled_weight(w))
        want = ck.linear(xs, ck.pack_linear_weight(scaled.dequantize(w)))
        assert torch.isfinite(got).all()
        assert torch.equal(got, want)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # -0.0 too


@pytest.mark.parametrize("fmt", scaled.FORMATS)
def test_cpu_kernel_keeps_the_stored_bytes(ck: CpuKernels, fmt: str) -> None:
    w = make(fmt, 64, 256, seed=3)
    packed = ck.pack_scaled_weight(w)
    assert packed.data.numel() == w.data.numel()  # 64 rows: no padding, a transpose
    assert sorted(packed.data.flatten().tolist()) == sorted(w.data.flatten().tolist())


@pytest.mark.parametrize("fmt", scaled.FORMATS)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_torch_reference_close_to_dense_fp32(
    tk: TorchKernels, fmt: str, m: int, n: int, k: int
) -> None:
    """The reference dequantizes 128 rows at a time and multiplies in fp32: the same
    products, summed in BLAS's order, so equal up to fp32 summation noise (1e-5)."""
    w = make(fmt, n, k, seed=m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(n)
    packed = tk.pack_scaled_weight(w)
    assert packed.data is w.data  # resident as stored
    got = tk.linear(x, packed, bias)
    dense = scaled.dequantize(w)
    want = F.linear(x.double(), dense.double(), bias.double()).float()
    scale = float(x.abs().sum(1).max() * dense.abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * scale + 1e-6)
    assert tk.linear(x.bfloat16(), packed, bias.bfloat16()).dtype == torch.bfloat16


def test_reference_never_dequantizes_more_than_a_row_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[int] = []
    real = scaled.dequantize_rows

    def spy(w: ScaledWeight, start: int, stop: int) -> torch.Tensor:
        seen.append(stop - start)
        return real(w, start, stop)

    monkeypatch.setattr(scaled, "dequantize_rows", spy)
    w = make("fp4", 300, 64, seed=1)
    scaled.reference_linear(torch.randn(2, 64), w)
    assert seen == [128, 128, 44]


def test_cat_rows_and_bad_shapes() -> None:
    a, b = make("fp4", 5, 64, 1), make("fp4", 3, 64, 2)
    cat = scaled.cat_rows([a, b])
    assert cat is not None and cat.shape == (8, 64)
    assert torch.equal(scaled.dequantize(cat), torch.cat([scaled.dequantize(p) for p in (a, b)]))
    assert scaled.cat_rows([a, make("fp8", 3, 64, 1)]) is None
    with pytest.raises(ValueError, match="uint8"):
        ScaledWeight(torch.zeros(4, 31, dtype=torch.uint8), a.scale[:4], "fp4", 64, 32)
    with pytest.raises(ValueError, match="scale"):
        ScaledWeight(a.data, a.scale[:, :1], "fp4", 64, 32)
    with pytest.raises(ValueError, match="format"):
        ScaledWeight(a.data, a.scale, "fp6", 64, 32)
    with pytest.raises(ValueError, match="scale grid"):
        scaled.from_fp8_blocks(torch.zeros(4, 8).to(torch.float8_e4m3fn), torch.ones(2, 1), (2, 4))
    with pytest.raises(ValueError, match="ue8m0"):
        scaled.from_fp4_packed(a.data, a.scale.float(), 64)


@pytest.mark.parametrize("fmt", scaled.FORMATS)
def test_row_slice_is_the_weight_of_its_rows(ck: CpuKernels, fmt: str) -> None:
    """Rows [40, 170) cut through 128 x 128 blocks (fp8) and 16-row kernel blocks: the
    slice is the weight of those rows, and its product the whole product's columns."""
    w = make(fmt, 200, 130, seed=1)
    part = scaled.row_slice(w, 40, 170)
    assert part.shape == (130, 130) and part.fmt == fmt and part.group == w.group
    same_storage = part.data.untyped_storage().data_ptr() == w.data.untyped_storage().data_ptr()
    assert same_storage  # a view: no copy until packed
    assert torch.equal(scaled.dequantize(part), scaled.dequantize(w)[40:170])
    x = torch.randn(3, 130, generator=torch.Generator().manual_seed(2))
    whole = ck.linear(x, ck.pack_scaled_weight(w))
    assert torch.equal(ck.linear(x, ck.pack_scaled_weight(part)), whole[:, 40:170])
    for start, stop in ((5, 5), (-1, 3), (190, 201), (10, 4)):
        with pytest.raises(ValueError, match="not a non-empty slice of 200 rows"):
            scaled.row_slice(w, start, stop)


def test_cpu_op_rejects_mismatched_inputs(ck: CpuKernels) -> None:
    packed = ck.pack_scaled_weight(make("fp8", 20, 64, 1))
    with pytest.raises(RuntimeError, match="uint8"):
        ck.linear(torch.randn(1, 65), packed)
    with pytest.raises(RuntimeError, match="float32"):
        ck.linear(torch.randn(1, 64).double(), packed)


def test_non_finite_values_are_found() -> None:
    w = make("fp8", 4, 16, 1)
    assert scaled.check_finite(w)
    bad = w.data.clone()
    bad[2, 3] = 0xFF
    assert not scaled.check_finite(ScaledWeight(bad, w.scale, "fp8", 16, w.group))
    f = make("fp4", 4, 16, 1)
    assert scaled.check_finite(f)
    s = f.scale.clone()
    s[1, 0] = 0xFF
    assert not scaled.check_finite(ScaledWeight(f.data, s, "fp4", 16, 32))


def test_cpu_kernel_nan_bytes_give_nan(variant: CpuKernels) -> None:
    """A NaN e4m3 byte (0x7f / 0xff; refused at load) or ue8m0 scale byte (0xff) still
    reads as NaN, as dequantized."""
    w = make("fp8", 16, 32, 1)
    bad = w.data.clone()
    bad[3, 5], bad[9, 0] = 0x7F, 0xFF
    packed = variant.pack_scaled_weight(ScaledWeight(bad, w.scale, "fp8", 32, w.group))
    for rows in (1, 10):
        out = variant.linear(torch.ones(rows, 32), packed)
        assert torch.isnan(out[-1]).nonzero().flatten().tolist() == [3, 9]
    f = make("fp4", 16, 64, 1)
    s = f.scale.clone()
    s[7, 1] = 0xFF
    packed = variant.pack_scaled_weight(ScaledWeight(f.data, s, "fp4", 64, 32))
    for rows in (1, 10):
        out = variant.linear(torch.ones(rows, 64), packed)
        assert torch.isnan(out[-1]).nonzero().flatten().tolist() == [7]


def test_nan_free_fp8_takes_the_unchecked_decode(ck: CpuKernels, variant: CpuKernels) -> None:
    """fp8 weights without NaN bytes (all that the loader keeps) pack as the op's format 2,
    whose AVX2 decode skips the NaN check; with NaN bytes as format 0. Both formats give
    the same bits on NaN-free bytes, for decode rows and for buffered prompt rows (6-row
    tiles and their remainders)."""
    w = make("fp8", 70, 300, seed=3)
    packed = variant.pack_scaled_weight(w)
    assert packed.layout == "scaled-fp8-blocked16"
    bad = w.data.clone()
    bad[0, 0] = 0x7F
    nan_layout = variant.pack_scaled_weight(ScaledWeight(bad, w.scale, "fp8", 300, w.group))
    assert nan_layout.layout == "scaled-fp8-nan-blocked16"
    op = torch.ops.laneserve.scaled_linear
    x = torch.randn(13, 300, generator=torch.Generator().manual_seed(2))
    for rows in (1, 2, 4, 5, 7, 13):
        outs = [
            op(x[:rows], packed.data, packed.scale, 70, fmt, w.group, None, variant.scaled_isa)
            for fmt in (0, 2)
        ]
        assert torch.equal(outs[0], outs[1])
    with pytest.raises(RuntimeError, match="unknown format"):
        op(x[:1], packed.data, packed.scale, 70, 3, w.group, None, variant.scaled_isa)


def test_denormals_are_zero_keeps_fp8_subnormals(ck: CpuKernels, variant: CpuKernels) -> None:
    """With denormals read as zero (torch.set_flush_denormal(True)) the e4m3 subnormals
    (exponent field 0) still count: the AVX2 kernel's fp32 decode, which would make them
    fp32 subnormals, is not taken then."""
    g = torch.Generator().manual_seed(9)
    raw = torch.randint(0, 8, (48, 64), generator=g, dtype=torch.uint8)  # subnormals and 0
    raw |= torch.randint(0, 2, (48, 64), generator=g, dtype=torch.uint8) << 7
    w = scaled.from_fp8_blocks(raw.view(torch.float8_e4m3fn), torch.ones(1, 1), (128, 128))
    x = torch.randn(3, 64, generator=g)
    want = ck.linear(x, ck.pack_linear_weight(scaled.dequantize(w)))
    assert want.abs().sum() > 0
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        got = variant.linear(x, variant.pack_scaled_weight(w))
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(got, want)
