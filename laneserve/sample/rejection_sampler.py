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
- *alternatives* a_1..a_W (a token tree's other root children): further
  candidates for the first draft position, each with its own target row at
  position 1. Tried in rank order once d_0 is rejected: greedy accepts the one
  equal to argmax_0; sampling accepts a_j with probability p'(a_j), p' being p_0
  without the candidates tried before it, renormalised (all candidates are
  distinct one-hot drafts, so this is exact). An accepted a_j is followed by the
  bonus from its own row; if none is accepted, the recovered token comes from p_0
  without any candidate.
Every row emits accepted + 1 tokens (1..k+1), distributed exactly as the
target's own samples would be (the gpt-fast / Leviathan et al. rule).

All-greedy steps whose rows all verify the same number of drafts (the usual decode
step) take the same decisions in one fused op, `kernels.verify_greedy`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from laneserve.sample.sampler import SamplingBatch, exponential_noise, probabilities


@dataclass
class Alternatives:
    """The alternatives of some speculative rows, with their target rows' logits."""

    rows: torch.Tensor  # [Ra] sampling rows that carry alternatives
    tokens: torch.Tensor  # [Ra, W] distinct from each other and from the row's first draft
    logits: torch.Tensor  # [Ra * W, V] processed logits of each alternative's own row
    batch: SamplingBatch  # expanded to the Ra rows
    alt_batch: SamplingBatch  # expanded to the Ra * W alternative rows


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


def verify_alternatives(
    logits: torch.Tensor,  # [N, V] the processed logits given to verify()
    first: torch.Tensor,  # [R] logits row of each sampling row's position 0
    drafts: torch.Tensor,  # [R, K]
    num_valid: torch.Tensor,  # [R]
    tokens: torch.Tensor,  # [R, K + 1] from verify(), updated in place
    num_accepted: torch.Tensor,  # [R] from verify(), updated in place
    alt: Alternatives,
) -> tuple[torch.Tensor, torch.Tensor]:  # hit [Ra] bool, choice [Ra] int64 (index into W)
    """Try the alternatives of rows whose first draft was rejected (see the glossary)."""
    rows = alt.rows
    ra, w = alt.tokens.shape
    main_hit = num_accepted.index_select(0, rows) >= 1
    valid = num_valid.index_select(0, rows) >= 1
    bonus = alt.logits.argmax(dim=-1).view(ra, w)
    if alt.batch.all_greedy:
        # the emitted first token is argmax_0 already (the accepted draft equals it): a
        # hit only adds its bonus
        acc = (alt.tokens == tokens[rows, :1]) & (valid & ~main_hit)[:, None]
        hit = acc.any(dim=1)
        choice = acc.to(torch.int64).argmax(dim=1)
        second = torch.where(hit, bonus.gather(1, choice[:, None]).squeeze(1), tokens[rows, 1])
        tokens[rows, 1] = second
        num_accepted[rows] = torch.where(hit, 1, num_accepted[rows])
        return hit, choice
    l0 = logits.index_select(0, first.index_select(0, rows))  # [Ra, V]
    acc = (alt.tokens == l0.argmax(dim=-1)[:, None]) & (valid & ~main_hit)[:, None]  # greedy
    cands = torch.cat([drafts.index_select(0, rows)[:, :1], alt.tokens], dim=1)
    acc_r, bonus_r, recovered = _random_alternatives(l0, alt, cands)
    greedy = alt.batch.greedy[:, None]
    acc = torch.where(greedy, acc, acc_r & (valid & ~main_hit)[:, None])
    bonus = torch.where(greedy, bonus, bonus_r)
    hit = acc.any(dim=1)
    choice = acc.to(torch.int64).argmax(dim=1)  # the first accepted alternative
    pick = choice[:, None]
    mine = tokens.index_select(0, rows)
    col0 = torch.where(hit, alt.tokens.gather(1, pick).squeeze(1), mine[:, 0])
    redo = valid & ~main_hit & ~hit & ~alt.batch.greedy  # none accepted: p_0 minus them all
    mine[:, 0] = torch.where(redo, recovered, col0)
    mine[:, 1] = torch.where(hit, bonus.gather(1, pick).squeeze(1), mine[:, 1])
    tokens.index_copy_(0, rows, mine)
    num_accepted.index_copy_(
        0, rows, torch.where(hit, torch.ones_like(main_hit, dtype=torch.int64), num_accepted[rows])
    )
    return hit, choice


def _random_alternatives(
    l0: torch.Tensor, alt: Alternatives, cands: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(accept [Ra, W], bonus [Ra, W], recovered [Ra]) for sampled rows."""
    ra, w = alt.tokens.shape
    p0 = probabilities(l0, alt.batch)  # [Ra, V]
    pc = p0.gather(1, cands)  # [Ra, 1 + W]: the first draft, then the alternatives
    tried = (pc.cumsum(dim=1) - pc)[:, 1:]  # mass of the candidates tried before each
    p_res = pc[:, 1:] / (1.0 - tried).clamp_min(1e-30)
    accept = _uniform_rows(alt.batch, w, l0.device) < p_res
    residual = p0.scatter(1, cands, torch.zeros_like(pc))
    residual = residual / residual.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    noise = exponential_noise(alt.batch, tuple(residual.shape), l0.device)
    recovered = (residual / noise).argmax(dim=-1)
    pa = probabilities(alt.logits, alt.alt_batch)  # [Ra * W, V]
    noise = exponential_noise(alt.alt_batch, tuple(pa.shape), l0.device)
    bonus = (pa / noise).argmax(dim=-1).view(ra, w)
    return accept, bonus, recovered


def _uniform(batch: SamplingBatch, n: int, device: torch.device) -> torch.Tensor:
    return _uniform_rows(batch, 1, device).view(n)


def _uniform_rows(batch: SamplingBatch, width: int, device: torch.device) -> torch.Tensor:
    """U[0, 1) of shape [R, width]; seeded rows draw from their own generator."""
    u = torch.empty((len(batch.generators), width), device=device)
    if not batch.seeded:
        return u.uniform_(generator=batch.shared_generator)
    for i, gen in enumerate(batch.generators):
        u[i].uniform_(generator=gen if gen is not None else batch.shared_generator)
    return u
