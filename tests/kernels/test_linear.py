"""linear / pack_linear_weight: CpuKernels vs TorchKernels vs float64 references."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from laneserve.kernels import (
    BATCH_INVARIANT_MAX_M,
    CpuKernels,
    TorchKernels,
    load_kernels,
    quantize_int8,
)
from laneserve.kernels import build as kbuild
from tests.kernels.helpers import WEIGHT_DTYPES, randn


def linear_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().T
    return out if bias is None else out + bias.double()


def assert_linear_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    ref = linear_ref(x, w, None)
    # fp32 accumulation over K terms: error bound scales with sum_k |x||w|.
    bound = 2e-5 * (x.double().abs() @ w.double().abs().T) + 1e-30
    assert y.shape == ref.shape and y.dtype == torch.float32
    assert ((y.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("n,k", [(960, 576), (37, 72), (16, 13), (200, 1536)])
def test_linear_matches_reference(ck: CpuKernels, tk: TorchKernels, dtype, n, k) -> None:
    w = randn(n, k, seed=n + k).to(dtype)
    pw = ck.pack_linear_weight(w)
    assert (pw.out_features, pw.in_features, pw.dtype) == (n, k, dtype)
    tw = tk.pack_linear_weight(w)
    for m in (1, 3, 7, 33, 100):
        x = randn(m, k, seed=m)
        y = ck.linear(x, pw)
        assert_linear_close(y, x, w)
        assert_linear_close(tk.linear(x, tw), x, w)


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
def test_linear_bias(ck: CpuKernels, dtype) -> None:
    w = randn(45, 72, seed=1).to(dtype)
    b = randn(45, seed=2)
    x = randn(5, 72, seed=3)
    y = ck.linear(x, ck.pack_linear_weight(w), b)
    torch.testing.assert_close(y.double(), linear_ref(x, w, b), rtol=1e-5, atol=1e-5)
    # NOTE: bias is added after the full K chain: exactly (x @ w^T) + b in fp32.
    assert torch.equal(y, ck.linear(x, ck.pack_linear_weight(w)) + b)


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
def test_linear_batch_invariance(ck: CpuKernels, dtype) -> None:
    w = randn(3072 + 5, 576, seed=7).to(dtype)  # N not a multiple of 16
    pw = ck.pack_linear_weight(w)
    bias = randn(w.shape[0], seed=8)
    probe = randn(1, 576, seed=9)
    alone = ck.linear(probe, pw, bias)
    for m in (2, 5, 6, 7, 17, 64):
        assert m <= BATCH_INVARIANT_MAX_M
        for at in {0, m // 2, m - 1}:
            batch = randn(m, 576, seed=100 + m + at, scale=3.0)
            batch[at] = probe[0]
            out = ck.linear(batch, pw, bias)
            assert torch.equal(out[at], alone[0]), (m, at)
    # Every row of a batch equals its own single-row call.
    batch = randn(33, 576, seed=11)
    out = ck.linear(batch, pw, bias)
    for r in range(33):
        assert torch.equal(out[r], ck.linear(batch[r : r + 1], pw, bias)[0])


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
def test_linear_isa_variants_bit_identical(ck: CpuKernels, dtype) -> None:
    """The AVX-512 linear gives the AVX2 linear's bits (same FMA chain per element)."""
    if not (kbuild.cpu_flags() or set()) >= kbuild.AVX512_CPU_FLAGS:
        pytest.skip("this CPU has no AVX-512 F+BW")
    lib = load_kernels()
    k2 = CpuKernels(dataclasses.replace(lib, isa="avx2"))
    k512 = CpuKernels(dataclasses.replace(lib, isa="avx512"))
    assert k2.isa == "avx2" and k512.isa == "avx512"
    for n, k in [(960, 576), (37, 33), (16, 1), (200, 1536), (130, 7)]:  # odd K: bf16 padding
        w = randn(n, k, seed=n * k).to(dtype)
        bias = randn(n, seed=n)
        p2, p512 = k2.pack_linear_weight(w), k512.pack_linear_weight(w)
        assert p2.layout != p512.layout
        for m in (1, 2, 3, 5, 6, 7, 13, 64):
            x = randn(m, k, seed=m + k, scale=2.0)
            assert torch.equal(k512.linear(x, p512, bias), k2.linear(x, p2, bias)), (n, k, m)
            assert torch.equal(k512.linear(x, p512), k2.linear(x, p2)), (n, k, m)


def test_linear_int8_weights(ck: CpuKernels, tk: TorchKernels) -> None:
    """Weight-only int8: both ISAs give the same bits, match the dequantized weight in
    float64, keep batch invariance; a bad scale or quantization name is an error."""
    lib = load_kernels()
    variants = [ck]
    if (kbuild.cpu_flags() or set()) >= kbuild.AVX512_CPU_FLAGS:
        variants = [CpuKernels(dataclasses.replace(lib, isa=i)) for i in ("avx2", "avx512")]
    for n, k in [(960, 576), (37, 33), (16, 1), (130, 7)]:
        w = randn(n, k, seed=n + k).to(torch.bfloat16)
        bias = randn(n, seed=n)
        q, scale = quantize_int8(w)
        assert q.dtype == torch.int8 and int(q.abs().max()) == 127
        deq = q.double() * scale.double()[:, None]
        assert (deq - w.double()).abs().max() <= scale.max() / 2 + 1e-6  # rounding, no clip
        tw = tk.pack_linear_weight(w, "int8")
        outs = []
        for kern in variants:
            pw = kern.pack_linear_weight(w, "int8")
            assert pw.dtype == torch.int8 and pw.scale is not None
            x = randn(13, k, seed=k, scale=2.0)
            y = kern.linear(x, pw, bias)
            ref = x.double() @ deq.T + bias.double()
            torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(y, tk.linear(x, tw, bias), rtol=1e-5, atol=1e-4)
            for m in (1, 2, 6, 7):  # batch invariance: row 0 alone equals row 0 in a batch
                assert torch.equal(kern.linear(x[:m], pw, bias)[0], y[0]), (n, k, m)
            outs.append(y)
        assert all(torch.equal(o, outs[0]) for o in outs)  # AVX2 and AVX-512: same bits
    pw = ck.pack_linear_weight(randn(20, 8, seed=1), "int8")
    with pytest.raises(RuntimeError, match="scale"):
        ck._linear(randn(2, 8, seed=3), pw.data, 20, None, ck._isa, None)
    with pytest.raises(RuntimeError, match="scale"):
        ck._linear(randn(2, 8, seed=3), pw.data, 20, None, ck._isa, torch.ones(19))
    with pytest.raises(ValueError, match="unknown weight quantization"):
        ck.pack_linear_weight(randn(20, 8, seed=1), "int4")
    with pytest.raises(ValueError, match="unknown weight quantization"):
        tk.pack_linear_weight(randn(20, 8, seed=1), "fp8")
    zero = torch.zeros(4, 8)
    q, scale = quantize_int8(zero)  # an all-zero row quantizes to zeros, scale 1
    assert not q.any() and torch.equal(scale, torch.ones(4))


def test_linear_isa_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kbuild, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    assert kbuild.linear_isa() == "avx2"
    monkeypatch.setattr(kbuild, "cpu_flags", lambda: {"avx2", "fma", "f16c", "avx512f", "avx512bw"})
    assert kbuild.linear_isa() == "avx512"
    monkeypatch.setenv(kbuild.ISA_ENV, "AVX2")
    assert kbuild.linear_isa() == "avx2"
    monkeypatch.setenv(kbuild.ISA_ENV, "sse")
    with pytest.raises(ValueError, match="must be one of avx2, avx512"):
        kbuild.linear_isa()
    monkeypatch.setattr(kbuild, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.setenv(kbuild.ISA_ENV, "avx512")
    with pytest.raises(ValueError, match="lacks"):
        kbuild.linear_isa()


def test_linear_edge_cases(ck: CpuKernels) -> None:
    pw = ck.pack_linear_weight(randn(20, 8, seed=1))
    assert ck.linear(torch.empty(0, 8), pw).shape == (0, 20)
    x = randn(8, 16, seed=2)[:, ::2]  # non-contiguous input
    torch.testing.assert_close(ck.linear(x, pw), ck.linear(x.contiguous(), pw), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="in_features mismatch: x has 9, weight 8"):
        ck.linear(randn(2, 9, seed=3), pw)
    with pytest.raises(RuntimeError, match="x must be a 2-D float32 tensor"):
        ck.linear(randn(2, 8, seed=3).double(), pw)
    with pytest.raises(TypeError):
        ck.pack_linear_weight(torch.zeros(4, 4, dtype=torch.int32))


def test_isa_env_forces_the_loaded_variant(ck: CpuKernels, monkeypatch: pytest.MonkeyPatch) -> None:
    """LANESERVE_KERNEL_ISA picks linear's variant as the kernels load: the same built
    library (the variant is chosen at load, not compiled in, so nothing rebuilds), the
    forced variant's weight layout and prompt-row paths, and the same bits. avx512 is
    forced where the CPU has AVX-512 F+BW, and refused where it has not."""
    from laneserve.kernels.cpu import LAYOUT_BLOCKED, LAYOUT_BLOCKED_512

    w, x = randn(48, 64, seed=21).bfloat16(), randn(5, 64, seed=22)
    want = ck.linear(x, ck.pack_linear_weight(w))
    has_512 = (kbuild.cpu_flags() or set()) >= kbuild.AVX512_CPU_FLAGS
    for isa, layout in [("avx2", LAYOUT_BLOCKED), ("avx512", LAYOUT_BLOCKED_512)]:
        monkeypatch.setenv(kbuild.ISA_ENV, isa)
        if isa == "avx512" and not has_512:
            with pytest.raises(ValueError, match="lacks"):
                load_kernels()
            continue
        lib = load_kernels()
        assert lib is not None and (lib.isa, lib.library_path) == (isa, ck.lib.library_path)
        if isa == "avx2":
            assert not (lib.amx or lib.dpbf16 or lib.vnni or lib.bf16_dot or lib.vbmi)  # AVX-512
        forced = CpuKernels(lib)
        pw = forced.pack_linear_weight(w)
        assert pw.layout == layout
        assert torch.equal(forced.linear(x, pw), want)
