"""Routed experts spread over the expert-parallel ranks (docs/distributed.md).

```
 home rank (its tokens)                 expert ranks (their experts)
 route -> pairs sorted by expert ──a2a──> rows grouped by (expert, decode|prompt)
                                          each local expert on its rows
 weight, sum per token in expert order <──a2a── outputs, in the order they came
```
Routing runs where the token lives, so V4's hash routing reads its own token ids and
nothing but rows crosses. Experts are contiguous per rank (rank r holds E/D of them), so
the pairs sorted by expert are already grouped by destination. Each row travels with its
expert and whether it is a prompt row (the kernels treat those apart), and the outputs
come back in the order the home rank sent them, where `expert_groups.combine` adds them
exactly as on one rank. With batch-invariant kernels (the CPU kernels: each row's sums in
a fixed order whatever its neighbours) a rank's results are therefore bit-identical to
expert parallelism off.

A rank with no tokens still takes part (`idle`): it receives rows for its experts and
sends their outputs back.
"""

from __future__ import annotations

import torch

from laneserve.distributed.expert_parallel import ExpertParallel
from laneserve.model.layers.expert_groups import ExpertFn, combine, plan_pairs

_DECODE, _PROMPT = 0, 1


class ExpertExchange:
    def __init__(self, ep: ExpertParallel, num_experts: int, expert: ExpertFn) -> None:
        self.ep, self.expert = ep, expert
        self.per_rank = len(ep.experts(num_experts))

    def __call__(
        self,
        x: torch.Tensor,  # [T, H]
        weights: torch.Tensor,  # [T, k] routing weights
        ids: torch.Tensor,  # [T, k] chosen experts (global ids)
        first_prefill: int | None = None,  # tokens [first_prefill, T) are prompt tokens
    ) -> torch.Tensor:  # [T, H]
        plan = plan_pairs(ids)
        experts = plan.experts
        prompt = first_prefill if first_prefill is not None else x.shape[0]
        kinds = [_PROMPT if t >= prompt else _DECODE for t in plan.tokens]
        send = [0] * self.ep.size
        for e in experts:
            send[e // self.per_rank] += 1
        dev = x.device
        rows = x.index_select(0, torch.tensor(plan.tokens, dtype=torch.int64, device=dev))
        tags = torch.tensor(list(zip(experts, kinds, strict=True)), dtype=torch.int64, device=dev)
        y = self._exchange(rows, tags.view(-1, 2), send)
        return combine(y, weights, plan)

    def idle(self, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        """Take part in the exchange with no tokens of this rank's own."""
        rows = torch.empty((0, hidden), dtype=dtype, device=device)
        tags = torch.empty((0, 2), dtype=torch.int64, device=device)
        self._exchange(rows, tags, [0] * self.ep.size)

    def _exchange(self, rows: torch.Tensor, tags: torch.Tensor, send: list[int]) -> torch.Tensor:
        """The outputs of `rows` [P, H] (sent to their experts' ranks), in their order."""
        ep = self.ep
        recv = ep.counts(send)
        got = ep.all_to_all(rows, send, recv)
        got_tags = ep.all_to_all(tags, send, recv)
        out = self._run(got, got_tags)
        return ep.all_to_all(out, recv, send)

    def _run(self, rows: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        """This rank's experts on the rows it received, outputs in the received order.
        Each expert gets its decode rows first, then its prompt rows."""
        if rows.shape[0] == 0:
            return rows
        keys = tags.tolist()
        order = sorted(range(len(keys)), key=lambda i: (keys[i][0], keys[i][1]))
        idx = torch.tensor(order, dtype=torch.int64, device=rows.device)
        xs = rows.index_select(0, idx)
        outs, start = [], 0
        while start < len(order):
            e = keys[order[start]][0]
            end, decode = start, 0
            while end < len(order) and keys[order[end]][0] == e:
                decode += keys[order[end]][1] == _DECODE
                end += 1
            first = decode if decode < end - start else None
            outs.append(self.expert(e, xs[start:end], first))
            start = end
        y = outs[0] if len(outs) == 1 else torch.cat(outs)
        return torch.empty_like(y).index_copy_(0, idx, y)
