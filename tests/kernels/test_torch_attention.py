"""TorchKernels' paged attention paths and KV write (kernels/torch_attention.py)."""

from __future__ import annotations

import pytest
import torch

from laneserve.kernels import torch_attention
from tests.host_reads import HostRead, no_host_reads
from tests.kernels.helpers import attention_f64, make_attn_case, randn

CASES = [
    # seq_lens, q_lens, hq, hk, block_size
    ([140], [1], 9, 3, 16),
    ([1, 15, 16, 17, 33, 140], [1, 1, 4, 1, 8, 3], 9, 3, 16),
    ([5, 40, 31], [1, 4, 3], 4, 4, 1),
    ([300, 64], [2, 1], 4, 4, 16),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", CASES)
def test_gathered_matches_per_sequence_and_f64(dtype, cfg) -> None:
    case = make_attn_case(*cfg, dtype=dtype, seed=len(cfg[0]))
    gathered = torch_attention.gathered_attention(*case.args())
    looped = torch_attention.per_sequence_attention(*case.args())
    torch.testing.assert_close(gathered, looped, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(gathered.double(), attention_f64(case), rtol=1e-5, atol=2e-6)


def test_gathered_ignores_what_lies_past_each_sequence() -> None:
    """Uninitialised cache memory (NaN, inf) in the unused tail of a sequence's last block
    and in table columns past its blocks leaves every row finite and unchanged."""
    case = make_attn_case([17, 5, 33], [1, 2, 1], 4, 2, 16, torch.float32, seed=7)
    clean = torch_attention.gathered_attention(*case.args())
    owned = set(case.block_tables[case.block_tables >= 0].tolist())
    spare = min(set(range(case.k_cache.shape[0])) - owned)  # a block no sequence owns
    for cache in (case.k_cache, case.v_cache):
        for s, n in enumerate(case.seq_lens.tolist()):
            block = case.block_tables[s, (n - 1) // 16]
            cache[block, (n - 1) % 16 + 1 :] = float("nan")
        cache[spare] = float("inf")
    case.block_tables[:, -1] = spare
    dirty = torch_attention.gathered_attention(*case.args())
    assert torch.isfinite(dirty).all()
    torch.testing.assert_close(dirty, clean, rtol=0, atol=0)


def test_gathered_last_slot_reads_that_slot() -> None:
    hq, hk, d, bs = 6, 2, 64, 16
    kc, vc = randn(12, bs, hk, d, seed=1), randn(12, bs, hk, d, seed=2)
    table = torch.tensor([[3, 5, 7], [8, 2, 9]], dtype=torch.int32)
    lens = torch.tensor([37, 20], dtype=torch.int32)
    qsl = torch.tensor([0, 3, 4], dtype=torch.int32)  # sequence 0 verifies 3 tokens
    q = randn(4, hq, d, seed=3)
    last = torch.tensor([11 * bs + 4, -1])
    moved_k, moved_v = kc.clone(), vc.clone()  # sequence 0's last key put in its table slot
    moved_k[7, 4], moved_v[7, 4] = kc[11, 4], vc[11, 4]
    got = torch_attention.gathered_attention(q, kc, vc, table, lens, qsl, 0.125, last)
    ref = torch_attention.gathered_attention(q, moved_k, moved_v, table, lens, qsl, 0.125)
    loop = torch_attention.per_sequence_attention(q, kc, vc, table, lens, qsl, 0.125, last)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch.testing.assert_close(got, loop, rtol=1e-5, atol=2e-6)
    plain = torch_attention.gathered_attention(q, kc, vc, table, lens, qsl, 0.125)
    assert torch.equal(got[:2], plain[:2])  # earlier queries do not see the last key
    assert not torch.equal(got[2], plain[2])


def test_paths_are_chosen_by_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    taken: list[str] = []
    for name in ("gathered_attention", "per_sequence_attention"):
        real = getattr(torch_attention, name)
        monkeypatch.setattr(
            torch_attention, name, lambda *a, _n=name, _r=real: (taken.append(_n), _r(*a))[1]
        )
    decode = make_attn_case([20, 30], [1, 3], 4, 2, 16, torch.float32)
    prompt = make_attn_case([40, 30], [40, 3], 4, 2, 16, torch.float32)
    torch_attention.paged_attention(*decode.args())
    torch_attention.paged_attention(*prompt.args())
    assert taken == ["gathered_attention", "per_sequence_attention"]


def test_gathered_path_and_kv_write_read_nothing_on_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    case = make_attn_case([17, 40], [1, 4], 4, 2, 16, torch.bfloat16)
    k, v = randn(5, 2, 64, seed=4), randn(5, 2, 64, seed=5)
    slots = torch.tensor([3, -1, 40, 41, 42])
    with no_host_reads(monkeypatch):
        torch_attention.write_kv_cache(k, v, case.k_cache, case.v_cache, slots)
        torch_attention.gathered_attention(*case.args())
    with pytest.raises(HostRead), no_host_reads(monkeypatch):  # the guard can fail
        torch_attention.per_sequence_attention(*case.args())


@pytest.mark.parametrize("slots", [[-1, -1, -1], [-1, 5, -2], [7, 7, -1]])
def test_kv_write_skips_negative_slots(slots: list[int]) -> None:
    k, v = randn(3, 2, 8, seed=1), randn(3, 2, 8, seed=2)
    kc, vc = randn(4, 4, 2, 8, seed=3), randn(4, 4, 2, 8, seed=4)
    want_k, want_v = kc.clone(), vc.clone()
    for i, s in enumerate(slots):  # in order: a repeated slot keeps its last row
        if s >= 0:
            want_k.view(-1, 2, 8)[s], want_v.view(-1, 2, 8)[s] = k[i], v[i]
    if slots == [7, 7, -1]:  # index_copy_ leaves the order of repeats unspecified
        k[1], v[1] = k[0], v[0]
        want_k.view(-1, 2, 8)[7], want_v.view(-1, 2, 8)[7] = k[0], v[0]
    torch_attention.write_kv_cache(k, v, kc, vc, torch.tensor(slots))
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
