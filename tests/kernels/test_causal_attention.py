"""Attention of long prompt chunks in bf16 (causal_attention.cpp): close to fp32 attention
of the same bf16-rounded values, closer than torch's bf16 SDPA; each query's result
independent of the chunk length, of the context before the chunk and of the thread split;
shapes it cannot take go to the torch implementation; bad input is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from laneserve.kernels import CpuKernels, TorchKernels


@pytest.fixture
def bf16(ck: CpuKernels) -> CpuKernels:
    if not ck.bf16_dot:
        pytest.skip("this CPU has no avx512_bf16")
    return ck


def qkv(n: int, hq: int, hk: int, dk: int, dv: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, h, d, generator=g) * 2 for h, d in ((hq, dk), (hk, dk), (hk, dv))]


def fp32_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Causal attention in fp64 of the bf16-rounded inputs: what the kernel approximates."""
    q, k, v = (t.bfloat16().double().transpose(0, 1) for t in (q, k, v))
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return out.transpose(0, 1).float()


SHAPES = [
    (1, 1, 1, 64, 64),
    (5, 9, 3, 64, 64),
    (63, 4, 4, 32, 32),
    (64, 2, 1, 64, 64),
    (65, 6, 2, 64, 48),
    (130, 4, 2, 192, 128),  # MLA-style: wider keys than values
    (333, 8, 1, 128, 128),
    (1100, 9, 3, 64, 64),
]


@pytest.mark.parametrize(("n", "hq", "hk", "dk", "dv"), SHAPES)
def test_close_to_fp32_attention_and_closer_than_torch_bf16(
    bf16: CpuKernels, tk: TorchKernels, n: int, hq: int, hk: int, dk: int, dv: int
) -> None:
    q, k, v = qkv(n, hq, hk, dk, dv, seed=n)
    scale = dk**-0.5
    got = bf16.causal_attention_bf16(q, k, v, scale)
    assert got.shape == (n, hq, dv) and got.dtype == torch.float32
    want = fp32_attention(q, k, v, scale)
    err = (got - want).abs().max().item()
    assert err < 2e-2  # probabilities rounded to bf16: ~2^-9 of |v| per product
    if dk == dv:
        assert err <= (tk.causal_attention_bf16(q, k, v, scale) - want).abs().max().item()


def test_rows_do_not_depend_on_chunk_length_or_threads(bf16: CpuKernels) -> None:
    q, k, v = qkv(300, 6, 2, 64, 64, seed=7)
    whole = bf16.causal_attention_bf16(q, k, v, 0.125)
    # causal: the first m rows of a chunk of n are the rows of the chunk of m
    for m in (1, 64, 65, 129, 250):
        assert torch.equal(bf16.causal_attention_bf16(q[:m], k[:m], v[:m], 0.125), whole[:m])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = bf16.causal_attention_bf16(q, k, v, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, whole)


@pytest.mark.parametrize(("n", "nk"), [(1, 1), (1, 200), (70, 130), (200, 200), (129, 1300)])
def test_a_chunk_after_context_equals_those_rows_of_the_whole(
    bf16: CpuKernels, tk: TorchKernels, n: int, nk: int
) -> None:
    """Queries are the chunk's last n positions of nk: the same bits as in one fresh call."""
    q, k, v = qkv(nk, 6, 2, 64, 32, seed=nk)
    whole = bf16.causal_attention_bf16(q, k, v, 0.125)
    got = bf16.causal_attention_bf16(q[nk - n :], k, v, 0.125)
    assert torch.equal(got, whole[nk - n :])
    want = tk.causal_attention_bf16(q[nk - n :], k, v, 0.125)  # masked bf16 SDPA
    torch.testing.assert_close(got, want, rtol=0, atol=3e-2)


def test_a_query_sees_only_earlier_keys(bf16: CpuKernels) -> None:
    q, k, v = qkv(80, 2, 2, 32, 32, seed=3)
    k2, v2 = k.clone(), v.clone()
    k2[50:], v2[50:] = 1e3, -1e3  # later keys: would swamp any row that saw them
    a = bf16.causal_attention_bf16(q, k, v, 0.2)
    b = bf16.causal_attention_bf16(q, k2, v2, 0.2)
    assert torch.equal(a[:50], b[:50])
    assert not torch.equal(a[50:], b[50:])


def test_shapes_it_cannot_take_go_to_torch(
    bf16: CpuKernels, tk: TorchKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    inner = tk.causal_attention_bf16
    monkeypatch.setattr(
        bf16._fallback,
        "causal_attention_bf16",
        lambda q, *a: calls.append(q.shape[-1]) or inner(q, *a),
    )
    for d in (40, 272):  # values not in 16-column vectors; wider than the stack accumulator
        q, k, v = qkv(20, 2, 1, d, d)
        out = bf16.causal_attention_bf16(q, k, v, 0.1)
        torch.testing.assert_close(out, fp32_attention(q, k, v, 0.1), rtol=0, atol=3e-2)
    assert calls == [40, 272]


def test_bad_input_is_refused(bf16: CpuKernels) -> None:
    op = bf16.lib.op("causal_attention_bf16")
    q, k, v = qkv(10, 4, 2, 32, 32)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        op(q, k[:, :1].expand(10, 3, 32), v[:, :1].expand(10, 3, 32), 0.1)
    with pytest.raises(RuntimeError, match="shapes do not agree"):
        op(q, k[:9], v[:9], 0.1)  # fewer keys than queries
    with pytest.raises(RuntimeError, match="shapes do not agree"):
        op(q, k, v[:9], 0.1)
    with pytest.raises(RuntimeError, match="must be \\[n, heads, head_dim\\]"):
        op(q[0], k, v, 0.1)
    with pytest.raises(RuntimeError, match="head_dim must be even"):
        op(q[..., :31], k[..., :31], v, 0.1)
    assert op(q[:0], k[:0], v[:0], 0.1).shape == (0, 4, 32)
