"""(token, slot) pairs grouped by expert, and each token's k results summed back.

The two halves every routed-experts path shares: `moe.grouped_experts` (the experts on
this rank) and `expert_exchange.ExpertExchange` (experts spread over ranks) run the
experts between them, so both add each token's results in the same (expert) order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

ExpertFn = Callable[[int, torch.Tensor, int | None], torch.Tensor]  # (e, rows, first_prefill)


@dataclass(frozen=True)
class PairPlan:
    """The pairs of ids [T, k] sorted by expert (stable): their flat indices, the tokens
    they belong to (ascending within an expert), the (expert, count) runs, and for each
    token (row-major) the positions of its pairs in that order (= its experts in order)."""

    order: list[int]
    tokens: list[int]
    counts: list[tuple[int, int]]
    by_token: list[int]
    shape: tuple[int, int]  # (T, k)

    @property
    def experts(self) -> list[int]:
        """Each sorted pair's expert."""
        return [e for e, n in self.counts for _ in range(n)]


def plan_pairs(ids: torch.Tensor) -> PairPlan:
    """NOTE: read on the host (one read per MoE layer): the per-expert slices need their
    sizes there, and sorting a few hundred ints in Python costs less than the torch ops."""
    t, k = ids.shape
    flat = ids.flatten().tolist()
    order = sorted(range(len(flat)), key=flat.__getitem__)
    counts: list[tuple[int, int]] = []
    per_token: list[list[int]] = [[] for _ in range(t)]
    for pos, i in enumerate(order):
        e = flat[i]
        per_token[i // k].append(pos)
        if counts and counts[-1][0] == e:
            counts[-1] = (e, counts[-1][1] + 1)
        else:
            counts.append((e, 1))
    by_token = [pos for row in per_token for pos in row]
    return PairPlan(order, [i // k for i in order], counts, by_token, (t, k))


def combine(y: torch.Tensor, weights: torch.Tensor, plan: PairPlan) -> torch.Tensor:
    """[T, H]: the experts' outputs y [T * k, H] (in the plan's order) weighted and each
    token's k results summed in expert order.

    NOTE: one gather and one reduction (as an index_add_ over the sorted rows would add
    them) instead of a zero fill and a scatter-add, which is slow on CPU."""
    t, k = plan.shape
    dev = y.device
    pairs = torch.tensor(plan.order, dtype=torch.int64, device=dev)
    y = y * weights.flatten().index_select(0, pairs)[:, None].to(y.dtype)
    gather = torch.tensor(plan.by_token, dtype=torch.int64, device=dev)
    return y.index_select(0, gather).view(t, k, -1).sum(dim=1)
