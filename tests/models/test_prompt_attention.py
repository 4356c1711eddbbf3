"""Prompt chunks' attention (model/layers/attention.py): on the CPU kernels a chunk reads the paged
cache through the decode rows' kernel, so a prompt token's attention is bit for bit what it
would be as a decode row, whatever the chunking; long chunks take the bf16 causal kernel
on a bf16 cache (fresh or after context), and torch SDPA when fresh on an fp32 cache."""

from __future__ import annotations

import pytest
import torch

from laneserve.kernels import CpuKernels, TorchKernels, load_kernels
from laneserve.model.layers import attention
from laneserve.model.layers.attention import AttentionMetadata, PrefillSpan

HQ, HK, D, BS = 6, 2, 32, 16


@pytest.fixture(scope="module")
def ck() -> CpuKernels:
    lib = load_kernels()
    if lib is None:
        pytest.skip("laneserve CPU kernels are not available here")
    return CpuKernels(lib)


def _cache(n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = n // BS + 2
    return torch.zeros(blocks, BS, HK, D, dtype=dtype), torch.zeros(blocks, BS, HK, D, dtype=dtype)


def _prefill(kernels, q, k, v, cache, context: int, start: int, n: int) -> torch.Tensor:
    """Attention of tokens start..start+n-1 as one prompt chunk (K/V of 0..start-1 cached)."""
    total = start + n
    blocks = torch.arange((total + BS - 1) // BS, dtype=torch.int64)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(start, total),
        num_decode_tokens=0,
        decode_block_tables=None,
        decode_seq_lens=None,
        decode_query_start_loc=None,
        prefills=(PrefillSpan(0, n, context, blocks),),
    )
    rows = slice(start, total)
    return attention.paged_attention(kernels, q[rows], k[rows], v[rows], cache, meta, 0.125)


def _decode_row(kernels, q, cache, pos: int) -> torch.Tensor:
    """Attention of the token at pos as a decode row (its K/V already cached)."""
    table = torch.arange((pos + 1 + BS - 1) // BS, dtype=torch.int32)[None]
    lens = torch.tensor([pos + 1], dtype=torch.int32)
    starts = torch.tensor([0, 1], dtype=torch.int32)
    return kernels.paged_attention(q[pos : pos + 1], *cache, table, lens, starts, 0.125)


def _record(monkeypatch: pytest.MonkeyPatch, ck: CpuKernels, op: str) -> list[int]:
    """The query count of every call of ck.<op> from now on."""
    calls: list[int] = []
    inner = getattr(ck, op)
    monkeypatch.setattr(ck, op, lambda q, *a: calls.append(len(q)) or inner(q, *a))
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prompt_rows_equal_decode_rows_whatever_the_chunking(ck: CpuKernels, dtype) -> None:
    n = 90
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, D, generator=g) for h in (HQ, HK, HK))
    one, chunked = _cache(n, dtype), _cache(n, dtype)
    whole = _prefill(ck, q, k, v, one, 0, 0, n)
    parts = [_prefill(ck, q, k, v, chunked, s, s, m) for s, m in ((0, 37), (37, 40), (77, 13))]
    assert torch.equal(torch.cat(parts), whole)  # chunks with context: the same bits
    for pos in (0, 15, 16, 54, 89):
        assert torch.equal(_decode_row(ck, q, one, pos), whole[pos : pos + 1])
    # and it is attention: close to torch's causal SDPA of the same (cache-rounded) values
    kr, vr = (t.to(dtype).float().repeat_interleave(HQ // HK, dim=1) for t in (k, v))
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), kr.transpose(0, 1), vr.transpose(0, 1), is_causal=True, scale=0.125
    ).transpose(0, 1)
    torch.testing.assert_close(whole, want, rtol=1e-4, atol=1e-5)


def test_long_fresh_chunks_take_sdpa(ck: CpuKernels, monkeypatch: pytest.MonkeyPatch) -> None:
    n = 40
    monkeypatch.setattr(attention, "PAGED_PREFILL_MAX_TOKENS", n - 1)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, h, D, generator=g) for h in (HQ, HK, HK))
    calls = _record(monkeypatch, ck, "paged_attention")
    cache = _cache(n, torch.float32)
    fresh = _prefill(ck, q, k, v, cache, 0, 0, n)  # over the limit: SDPA
    assert calls == []
    later = _prefill(ck, q, k, v, cache, 30, 30, 10)  # a chunk with context: the kernel
    assert calls == [10]
    torch.testing.assert_close(later, fresh[30:], rtol=1e-5, atol=1e-6)


def test_long_fresh_chunks_on_a_bf16_cache_take_the_causal_kernel(
    ck: CpuKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 70
    monkeypatch.setattr(attention, "PAGED_PREFILL_MAX_TOKENS", n - 1)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(n, h, D, generator=g) for h in (HQ, HK, HK))
    calls = _record(monkeypatch, ck, "causal_attention_bf16")
    fresh = _prefill(ck, q, k, v, _cache(n, torch.bfloat16), 0, 0, n)
    assert calls == [n]
    want = _prefill(ck, q, k, v, _cache(n, torch.bfloat16), 0, 0, 40)  # paged, fp32 sums
    torch.testing.assert_close(fresh[:40], want, rtol=0, atol=2e-2)


def test_long_chunks_after_context_on_a_bf16_cache_take_the_causal_kernel(
    ck: CpuKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 90
    monkeypatch.setattr(attention, "PAGED_PREFILL_MAX_TOKENS", 30)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(n, h, D, generator=g) for h in (HQ, HK, HK))
    calls = _record(monkeypatch, ck, "causal_attention_bf16")
    paged = _record(monkeypatch, ck, "paged_attention")
    whole = _prefill(ck, q, k, v, _cache(n, torch.bfloat16), 0, 0, n)
    cache = _cache(n, torch.bfloat16)
    parts = [_prefill(ck, q, k, v, cache, s, s, m) for s, m in ((0, 40), (40, 35), (75, 15))]
    assert calls == [n, 40, 35] and paged == [15]  # chunks of 30 or less stay paged
    if ck.bf16_dot:  # a blocked query's bits depend on its position and keys only
        assert torch.equal(torch.cat(parts[:2]), whole[:75])
    else:  # no avx512_bf16: torch's SDPA, whose sums depend on the chunk's shape
        torch.testing.assert_close(torch.cat(parts[:2]), whole[:75], rtol=0, atol=2e-2)
    torch.testing.assert_close(parts[2], whole[75:], rtol=0, atol=2e-2)  # paged: fp32 sums


def test_torch_kernels_keep_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    tk = TorchKernels()
    monkeypatch.setattr(tk, "paged_attention", lambda *a: pytest.fail("no paged prompt rows"))
    n = 20
    q, k, v = (torch.randn(n, h, D) for h in (HQ, HK, HK))
    out = _prefill(tk, q, k, v, _cache(n, torch.float32), 0, 0, n)
    assert out.shape == (n, HQ, D)
