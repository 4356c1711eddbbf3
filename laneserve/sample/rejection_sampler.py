"""Verify draft tokens against the target in one pass (greedy and rejection sampling).

Glossary (per speculative row with k draft slots, target positions 0..k):
- *draft* d_j: the proposed token that follows position j (the input at j + 1);
  only the first `num_valid` slots hold real drafts, the rest are never accepted.
- *accepted*: greedy rows accept d_j while it equals the target argmax at j;
  sampled rows accept with probability min(1, p_j(d_j) / q(d_j)). Drafts are
  deterministic (q is one-hot, for n-gram and MTP alike), so that is p_j(d_j).
- *recovered* token: at the first rejection, a sample from the residual
  max(p_j - q, 0) (p_j without d_j, renormalised) — greedy: the argmax.
- *bonus* token: after k accepted drafts, a plain sample from p_k.
Every row emits accepted + 1 tokens (1..k+1), distributed exactly as the
target's own samples would be (the gpt-fast / Leviathan et al. rule).
"""

from __future__ import annotations

import torch

from laneserve.sample.sampler import SamplingBatch, exponential_noise, probabilities


def verify(
    logits: torch.Tensor,  # [N, V] processed logits, one row per (row, offset)
    batch: SamplingBatch,  # expanded to the N logits rows
    flat_row: torch.Tensor,  # [N] int64: which speculative row
    flat_off: torch.Tensor,  # [N] int64: offset 0..k within it
    drafts: torch.Tensor,  # [R, K] draft tokens (K >= 1)
    num_valid: torch.Tensor,  # [R] real drafts per row
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [R, K + 1], num_accepted [R]
    r, k = drafts.shape
    valid = flat_off < num_valid.index_select(0, flat_row)  # [N]
    d = torch.where(
        valid, drafts[flat_row, flat_off.clamp(max=k - 1)], torch.full_like(flat_off, -1)
    )
    argmax = logits.argmax(dim=-1)
    if batch.all_greedy:
        accept, emit = valid & (d == argmax), argmax
    else:
        accept, emit = _random_accept(logits, batch, d, valid, argmax)
    acc = torch.zeros((r, k + 1), dtype=torch.bool, device=logits.device)
    acc[flat_row, flat_off] = accept
    num_accepted = acc[:, :k].to(torch.int64).cumprod(dim=1).sum(dim=1)
    emit_pad = torch.zeros((r, k + 1), dtype=torch.int64, device=logits.device)
    emit_pad[flat_row, flat_off] = emit
    d_pad = torch.zeros_like(emit_pad)
    d_pad[flat_row, flat_off] = d.clamp(min=0)
    cols = torch.arange(k + 1, device=logits.device)[None, :]
    tokens = torch.where(cols < num_accepted[:, None], d_pad, emit_pad)
    return tokens, num_accepted


def _random_accept(
    logits: torch.Tensor,
    batch: SamplingBatch,
    d: torch.Tensor,
    valid: torch.Tensor,
    argmax: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    probs = probabilities(logits, batch)  # [N, V]
    n, v = probs.shape
    safe_d = d.clamp(min=0)[:, None]
    p_d = probs.gather(1, safe_d).squeeze(1)
    u = _uniform(batch, n, probs.device)
    accept_random = valid & (u < p_d)
    bonus = (probs / exponential_noise(batch, (n, v), probs.device)).argmax(dim=-1)
    residual = probs.scatter(1, safe_d, torch.zeros_like(p_d)[:, None])
    residual = residual / residual.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    recovered = (residual / exponential_noise(batch, (n, v), probs.device)).argmax(dim=-1)
    emit = torch.where(valid, recovered, bonus)
    accept = torch.where(batch.greedy, valid & (d == argmax), accept_random)
    return accept, torch.where(batch.greedy, argmax, emit)


def _uniform(batch: SamplingBatch, n: int, device: torch.device) -> torch.Tensor:
    u = torch.empty(n, device=device)
    if not batch.seeded:
        return u.uniform_(generator=batch.shared_generator)
    for i, gen in enumerate(batch.generators):
        u[i : i + 1].uniform_(generator=gen if gen is not None else batch.shared_generator)
    return u
