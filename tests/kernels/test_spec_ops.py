"""Speculative-decoding ops of the kernels: the token tree's commit_side_rows.

verify_greedy, ngram_lookup, top_tokens and write_drafts are tested against their torch
composites in tests/spec (test_rejection_sampler.py, test_draft_slots.py).
"""

from __future__ import annotations

import pytest
import torch

from laneserve.kernels import CpuKernels, TorchKernels
from tests.kernels.helpers import gen


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
