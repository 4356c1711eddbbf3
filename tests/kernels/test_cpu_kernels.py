"""Tests for laneserve.kernels: CpuKernels vs TorchKernels vs float64 references.

The CpuKernels half is skipped when the extension cannot be built on this machine.
TorchKernels tests also run on CUDA when it is available.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from laneserve.kernels import (
    BATCH_INVARIANT_MAX_M,
    CpuKernels,
    TorchKernels,
    get_kernels,
    load_kernels,
    quantize_int8,
)
from laneserve.kernels import build as kbuild

WEIGHT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def ck() -> CpuKernels:
    buildable = (
        kbuild.cpu_supported()
        and not kbuild.kernels_disabled()
        and shutil.which(os.environ.get("CXX", "c++")) is not None
    )
    if not buildable:
        pytest.skip("laneserve CPU kernels cannot be built here (CPU, compiler or disabled)")
    lib = load_kernels()
    if lib is None:  # a toolchain is present, so this is a broken source or build setup
        pytest.fail("laneserve CPU kernel extension failed to build (see the WARNING log)")
    return CpuKernels(lib)


@pytest.fixture(scope="module")
def tk() -> TorchKernels:
    return TorchKernels()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen(seed)) * scale


# ----------------------------------------------------------------------------- linear


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
    with pytest.raises(RuntimeError):
        ck.linear(randn(2, 9, seed=3), pw)  # K mismatch
    with pytest.raises(RuntimeError):
        ck.linear(randn(2, 8, seed=3).double(), pw)
    with pytest.raises(TypeError):
        ck.pack_linear_weight(torch.zeros(4, 4, dtype=torch.int32))


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


# ----------------------------------------------------------------------------- paged attention


@dataclass
class AttnCase:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float
    k_seqs: list[torch.Tensor]  # per sequence [seq_len, Hk, D] (cache dtype values, fp32)
    v_seqs: list[torch.Tensor]

    def args(self) -> tuple:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.scale,
        )


def make_attn_case(
    seq_lens: list[int],
    q_lens: list[int],
    hq: int,
    hk: int,
    block_size: int,
    dtype: torch.dtype,
    d: int = 64,
    seed: int = 0,
) -> AttnCase:
    g = gen(seed)
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    k_cache = torch.randn(num_blocks, block_size, hk, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hk, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)  # shuffled, non-contiguous blocks
    max_blocks = max(blocks_per_seq) + 2
    block_tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    k_seqs, v_seqs, used = [], [], 0
    for s, nb in enumerate(blocks_per_seq):
        ids = perm[used : used + nb]
        used += nb
        block_tables[s, :nb] = ids.to(torch.int32)
        k_seqs.append(k_cache[ids].reshape(-1, hk, d)[: seq_lens[s]].float())
        v_seqs.append(v_cache[ids].reshape(-1, hk, d)[: seq_lens[s]].float())
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), hq, d, generator=g)
    return AttnCase(
        q,
        k_cache,
        v_cache,
        block_tables,
        torch.tensor(seq_lens, dtype=torch.int32),
        qsl,
        1.0 / math.sqrt(d),
        k_seqs,
        v_seqs,
    )


def attention_f64(case: AttnCase) -> torch.Tensor:
    out = torch.empty(case.q.shape, dtype=torch.float64)
    hq, hk = case.q.shape[1], case.k_cache.shape[2]
    for s, seq_len in enumerate(case.seq_lens.tolist()):
        q0, q1 = case.query_start_loc[s].item(), case.query_start_loc[s + 1].item()
        k = case.k_seqs[s].double().repeat_interleave(hq // hk, dim=1)  # [L, Hq, D]
        v = case.v_seqs[s].double().repeat_interleave(hq // hk, dim=1)
        for i in range(q1 - q0):
            pos = seq_len - (q1 - q0) + i
            scores = torch.einsum("hd,lhd->hl", case.q[q0 + i].double(), k[: pos + 1])
            p = torch.softmax(scores * case.scale, dim=-1)
            out[q0 + i] = torch.einsum("hl,lhd->hd", p, v[: pos + 1])
    return out


ATTN_CONFIGS = [
    # seq_lens, q_lens, hq, hk, block_size
    ([140], [1], 9, 3, 16),
    ([1, 15, 16, 17, 33, 140], [1, 1, 4, 1, 8, 3], 9, 3, 16),
    ([5, 40, 31], [1, 4, 31], 4, 4, 1),
    ([300, 64], [2, 1], 4, 4, 16),
    ([3, 9, 16, 17, 31, 32, 33, 50, 64, 65], [1, 2, 1, 1, 1, 9, 1, 1, 1, 1], 9, 3, 16),
]


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("cfg", ATTN_CONFIGS)
def test_paged_attention_matches_reference(ck: CpuKernels, tk: TorchKernels, dtype, cfg) -> None:
    case = make_attn_case(*cfg, dtype=dtype, seed=len(cfg[0]))
    ref = attention_f64(case)
    out = ck.paged_attention(*case.args())
    assert out.shape == case.q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(tk.paged_attention(*case.args()).double(), ref, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [128, 40])
def test_paged_attention_head_dims(ck: CpuKernels, dtype, d: int) -> None:
    case = make_attn_case([70, 3], [2, 1], 8, 2, 16, dtype, d=d, seed=d)
    out = ck.paged_attention(*case.args())
    torch.testing.assert_close(out.double(), attention_f64(case), rtol=1e-5, atol=2e-6)


@pytest.mark.cuda
def test_torch_paged_attention_cuda(tk: TorchKernels) -> None:
    case = make_attn_case([33, 140], [4, 1], 9, 3, 16, torch.bfloat16)
    args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in case.args()]
    out = tk.paged_attention(*args)
    torch.testing.assert_close(out.cpu().double(), attention_f64(case), rtol=1e-4, atol=1e-5)


# The kernel splits work per head, per GQA group or per sequence (all heads) depending
# on the batch size; these batches hit the different splits, the solo reruns the finest.
INVARIANCE_BATCHES = [
    ([1, 17, 140, 33, 64], [1, 4, 1, 1, 8]),
    ([1, 17, 140, 33, 64, 5, 16, 200, 2, 40], [1, 4, 1, 1, 8, 3, 1, 1, 2, 12]),
]


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("batch", INVARIANCE_BATCHES)
def test_paged_attention_batch_invariance(ck: CpuKernels, dtype, batch) -> None:
    seq_lens, q_lens = batch
    case = make_attn_case(seq_lens, q_lens, 9, 3, 16, dtype, seed=5)
    batched = ck.paged_attention(*case.args())
    qsl = case.query_start_loc.tolist()
    for s in range(len(seq_lens)):
        for i in range(q_lens[s]):
            # Query i of sequence s recomputed alone as a decode (q_len=1) step whose
            # sequence ends at that query's position, with the same cache.
            t = qsl[s] + i
            pos = seq_lens[s] - q_lens[s] + i
            alone = ck.paged_attention(
                case.q[t : t + 1],
                case.k_cache,
                case.v_cache,
                case.block_tables[s : s + 1],
                torch.tensor([pos + 1], dtype=torch.int32),
                torch.tensor([0, 1], dtype=torch.int32),
                case.scale,
            )
            assert torch.equal(alone[0], batched[t]), (s, i)


def test_paged_attention_errors(ck: CpuKernels) -> None:
    case = make_attn_case([20], [1], 4, 4, 16, torch.float32)
    with pytest.raises(RuntimeError):  # q_len > seq_len
        args = list(case.args())
        args[5] = torch.tensor([0, 1], dtype=torch.int32)
        args[4] = torch.tensor([0], dtype=torch.int32)
        ck.paged_attention(*args)
    with pytest.raises(RuntimeError):  # block id out of range
        args = list(case.args())
        args[3] = torch.full_like(case.block_tables, 10_000)
        ck.paged_attention(*args)


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
    res = x.clone()
    tk.fused_add_rms_norm(x.clone(), res, norm_w, 1e-6)
    assert tk.silu_and_mul(x).shape == (3, 32)
    case = make_attn_case([20, 5], [2, 1], 4, 2, 16, dt)
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in case.args()]
    args[0] = args[0].to(dt)
    out = tk.paged_attention(*args)
    assert out.dtype == dt
    torch.testing.assert_close(out.cpu().double(), attention_f64(case), rtol=0.05, atol=0.05)


# ----------------------------------------------------------------------------- kv cache


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_write_kv_cache(ck: CpuKernels, tk: TorchKernels, dtype, device: str) -> None:
    hk, d, bs, nb, t = 3, 64, 16, 6, 7
    kv = randn(t, 2 * hk * d, seed=1, scale=3.0)
    # Rounding corner cases: bf16 / fp16 ties, NaN, inf, overflow for fp16.
    kv[0, :6] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, float("nan"), -math.inf, 7e4])
    k = kv[:, : hk * d].view(t, hk, d)  # strided views (row stride 2*hk*d)
    v = kv[:, hk * d :].view(t, hk, d)
    slots = torch.tensor([0, 17, 95, -1, 33, 34, 50])
    impls = [tk] if device != "cpu" else [ck, tk]
    results = []
    for impl in impls:
        kc = torch.zeros(nb, bs, hk, d, dtype=dtype, device=device)
        vc = torch.zeros_like(kc)
        impl.write_kv_cache(k.to(device), v.to(device), kc, vc, slots.to(device))
        results.append((kc.cpu(), vc.cpu()))
    kc, vc = results[0]
    flat_k, flat_v = kc.view(-1, hk, d), vc.view(-1, hk, d)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            torch.testing.assert_close(flat_k[slot], k[i].to(dtype), rtol=0, atol=0, equal_nan=True)
            torch.testing.assert_close(flat_v[slot], v[i].to(dtype), rtol=0, atol=0, equal_nan=True)
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert (flat_k[untouched] == 0).all() and (flat_v[untouched] == 0).all()
    for other_k, other_v in results[1:]:
        torch.testing.assert_close(other_k, kc, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(other_v, vc, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
def test_paged_attention_last_slot(ck: CpuKernels, tk: TorchKernels, device: str) -> None:
    """last_slot[s] >= 0: sequence s reads its last key from that slot, exactly as if the
    table held it there (speculative side rows); -1 reads the table."""
    hq, hk, d, bs, nb = 6, 2, 64, 16, 12
    kc = randn(nb, bs, hk, d, seed=1).to(torch.bfloat16)
    vc = randn(nb, bs, hk, d, seed=2).to(torch.bfloat16)
    table = torch.tensor([[3, 5, 7], [3, 5, 7], [8, 2, 9]], dtype=torch.int32)
    seq_lens = torch.tensor([37, 37, 20], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    q = randn(3, hq, d, seed=3)
    last = torch.tensor([-1, 11 * bs + 4, -1])
    moved_k, moved_v = kc.clone(), vc.clone()  # sequence 1's last key put in its table slot
    moved_k[7, 4], moved_v[7, 4] = kc[11, 4], vc[11, 4]
    impls = [tk] if device != "cpu" else [ck, tk]
    for impl in impls:
        args = [x.to(device) for x in (kc, vc, table, seq_lens, qsl)]
        got = impl.paged_attention(q.to(device), *args[:2], *args[2:], 0.125, last.to(device))
        ref_args = [moved_k.to(device), moved_v.to(device), *args[2:]]
        ref = impl.paged_attention(q.to(device), *ref_args, 0.125)
        plain = impl.paged_attention(q.to(device), *args, 0.125)
        if impl is ck:
            assert torch.equal(got[1], ref[1]) and torch.equal(got[[0, 2]], plain[[0, 2]])
        else:
            torch.testing.assert_close(got, torch.cat([plain[:1], ref[1:2], plain[2:]]))
        assert not torch.equal(got[1], plain[1])
    with pytest.raises(RuntimeError, match="last_slot"):
        ck.paged_attention(q, kc, vc, table, seq_lens, qsl, 0.125, torch.tensor([0, 10**6, 0]))


def test_write_then_attend(ck: CpuKernels) -> None:
    """Decode step flow: write this token's K/V, then attend including it."""
    hk, hq, d, bs = 3, 9, 64, 16
    kc = torch.zeros(4, bs, hk, d, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    keys, vals = randn(20, hk, d, seed=1), randn(20, hk, d, seed=2)
    block_tables = torch.tensor([[2, 0]], dtype=torch.int32)
    slots = torch.tensor([block_tables[0, p // bs].item() * bs + p % bs for p in range(20)])
    ck.write_kv_cache(keys, vals, kc, vc, slots)
    q = randn(1, hq, d, seed=3)
    out = ck.paged_attention(
        q,
        kc,
        vc,
        block_tables,
        torch.tensor([20], dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32),
        0.125,
    )
    k = keys.to(torch.bfloat16).float().repeat_interleave(3, dim=1).transpose(0, 1)
    v = vals.to(torch.bfloat16).float().repeat_interleave(3, dim=1).transpose(0, 1)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, scale=0.125).transpose(0, 1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_slot_mapping_matches_torch(ck: CpuKernels, tk: TorchKernels, dtype) -> None:
    bs = 4
    table = torch.tensor([[7, 2, 9], [1, 0, 5]], dtype=dtype)
    rows = torch.tensor([0, 0, 1, 1, 1, 0])
    pos = torch.tensor([0, 5, 3, 8, 11, 9])
    want = [7 * 4 + 0, 2 * 4 + 1, 1 * 4 + 3, 5 * 4 + 0, 5 * 4 + 3, 9 * 4 + 1]
    for kern in (ck, tk):
        got = kern.slot_mapping(table, rows, pos, bs)
        assert got.dtype == torch.int64 and got.tolist() == want
    with pytest.raises(RuntimeError, match="outside the block table"):
        ck.slot_mapping(table, rows, torch.tensor([0, 0, 0, 0, 12, 0]), bs)
    with pytest.raises(RuntimeError, match="token row"):
        ck.slot_mapping(table, torch.tensor([2]), torch.tensor([0]), bs)


# ----------------------------------------------------------------------------- selection / build


def test_get_kernels_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(get_kernels(torch.device("meta")), TorchKernels)
    assert isinstance(get_kernels(torch.device("cpu"), enable=False), TorchKernels)
    monkeypatch.setenv(kbuild.DISABLE_ENV, "1")
    assert load_kernels() is None
    assert isinstance(get_kernels(torch.device("cpu")), TorchKernels)


def test_build_failure_falls_back(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(name: str, build_dir: Path) -> str:
        raise RuntimeError("compiler exploded")

    monkeypatch.setattr(kbuild, "_compile", broken)
    with caplog.at_level("WARNING", logger=kbuild.__name__):
        # __wrapped__: bypass the per-process cache of successful loads.
        assert kbuild._build_and_load.__wrapped__("laneserve_cpu_test", str(tmp_path)) is None
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "compiler exploded" in warnings[0].getMessage()


def test_unsupported_cpu_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kbuild, "cpu_supported", lambda: False)
    assert load_kernels() is None
    assert isinstance(get_kernels(torch.device("cpu")), TorchKernels)


def test_extension_name_tracks_source() -> None:
    src = kbuild.SOURCE.read_text()
    assert kbuild.extension_name(src) == kbuild.extension_name(src)
    assert kbuild.extension_name(src) != kbuild.extension_name(src + "\n// edit")


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(kbuild.CACHE_ENV, str(tmp_path))
    assert kbuild.cache_root() == tmp_path / "torch_extensions"


_BUILD_SNIPPET = """
import torch
from laneserve.kernels import get_kernels, CpuKernels
k = get_kernels(torch.device("cpu"))
assert isinstance(k, CpuKernels), k
print(k.linear(torch.ones(1, 8), k.pack_linear_weight(torch.ones(3, 8))).sum().item())
"""


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("LANESERVE_SLOW_TESTS") != "1", reason="cold builds: set LANESERVE_SLOW_TESTS=1"
)
def test_concurrent_cold_builds(tmp_path: Path) -> None:
    """Two processes building into an empty cache at once both end up with the kernels."""
    env = dict(os.environ, **{kbuild.CACHE_ENV: str(tmp_path)})
    env.pop(kbuild.DISABLE_ENV, None)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    procs = [
        subprocess.Popen([sys.executable, "-c", _BUILD_SNIPPET], env=env, stdout=subprocess.PIPE)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600)[0].decode().strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == ["24.0", "24.0"]


# ----------------------------------------------------------------------------- token tree


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_commit_side_rows_matches_torch(ck: CpuKernels, tk: TorchKernels, dtype) -> None:
    """The fused commit of accepted alternatives equals the torch composite: K/V copied
    from the chosen scratch slot in every layer, the hidden row replaced, only on a hit."""
    layers, blocks, bs, hk, d, r, w, h = 3, 6, 4, 2, 8, 4, 3, 16
    g = gen(7)
    k0 = torch.randn(layers, blocks, bs, hk, d, generator=g).to(dtype)
    v0 = torch.randn(layers, blocks, bs, hk, d, generator=g).to(dtype)
    side_slots = torch.arange(20, 20 + r * w, dtype=torch.int64).view(r, w)  # scratch: blocks 5-7
    side_slots = side_slots.clamp(max=blocks * bs - 1)
    real_slot = torch.tensor([1, 6, 9, 14])
    hit = torch.tensor([True, False, True, True])
    choice = torch.tensor([2, 1, 0, 1])
    hidden0 = torch.randn(10, h, generator=g)
    side_hidden = torch.randn(r * w, h, generator=g)
    first_draft = torch.tensor([1, 3, 5, 8])
    got, want = [], []
    for kern, out in ((ck, got), (tk, want)):
        k, v, hidden = k0.clone(), v0.clone(), hidden0.clone()
        kern.commit_side_rows(
            k, v, side_slots, real_slot, hit, choice, hidden, side_hidden, first_draft
        )
        out += [k, v, hidden]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    k, _, hidden = got
    flat = k.flatten(1, 2)
    assert torch.equal(flat[:, 1], k0.flatten(1, 2)[:, int(side_slots[0, 2])])  # a hit
    assert torch.equal(flat[:, 6], k0.flatten(1, 2)[:, 6])  # no hit: untouched
    assert torch.equal(hidden[5], side_hidden[2 * w + 0]) and torch.equal(hidden[3], hidden0[3])
    k, v, hidden = k0.clone(), v0.clone(), hidden0.clone()
    with pytest.raises(RuntimeError, match="out of range"):  # the last row's choice
        ck.commit_side_rows(
            k, v, side_slots, real_slot, hit, torch.tensor([2, 1, 0, 3]), hidden,
            side_hidden, first_draft,
        )  # fmt: skip
    assert torch.equal(k, k0) and torch.equal(v, v0) and torch.equal(hidden, hidden0)
    with pytest.raises(RuntimeError, match="int64"):
        ck.commit_side_rows(
            k, v0.clone(), side_slots, real_slot.int(), hit, choice, hidden, side_hidden,
            first_draft,
        )  # fmt: skip
