"""paged_attention, write_kv_cache and slot_mapping (TorchKernels also on CUDA)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from laneserve.kernels import CpuKernels, TorchKernels
from tests.kernels.helpers import (
    DEVICES,
    WEIGHT_DTYPES,
    attention_f64,
    make_attn_case,
    randn,
)

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
@pytest.mark.parametrize("d", [128, 40, 576])  # 576: DeepSeek V3's MLA latent (512 + 64)
def test_paged_attention_head_dims(ck: CpuKernels, dtype, d: int) -> None:
    case = make_attn_case([70, 3], [2, 1], 8, 2, 16, dtype, d=d, seed=d)
    out = ck.paged_attention(*case.args())
    torch.testing.assert_close(out.double(), attention_f64(case), rtol=1e-5, atol=2e-6)


def test_paged_attention_above_the_largest_head_dim(ck: CpuKernels) -> None:
    """The op refuses it; CpuKernels hands it to the reference."""
    case = make_attn_case([20, 5], [1, 2], 2, 1, 16, torch.float32, d=584, seed=3)
    with pytest.raises(RuntimeError, match="at most 576, got 584"):
        ck.lib.ops.paged_attention(*case.args())
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
    args = list(case.args())
    args[4] = torch.tensor([0], dtype=torch.int32)  # seq_len 0 < q_len 1
    with pytest.raises(RuntimeError, match="sequence 0 has q_len 1 > seq_len 0"):
        ck.paged_attention(*args)
    args = list(case.args())
    args[3] = torch.full_like(case.block_tables, 10_000)
    with pytest.raises(RuntimeError, match="block id out of range"):
        ck.paged_attention(*args)


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
