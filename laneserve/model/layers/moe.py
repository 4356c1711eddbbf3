"""Routed mixture of experts of the DeepSeek family, with shared experts.

Routing runs in fp32. `noaux_tc` (V3): sigmoid scores; the correction bias is
added for *selection* only; each group scores the sum of its top-2 biased
scores; the `topk_group` best groups are kept and the top-k experts chosen
among them; weights are the unbiased scores (renormalised with
`norm_topk_prob`), times `routed_scaling_factor`. `greedy` /
`group_limited_greedy` (V2): softmax scores, groups scored by their maximum.

Experts run as grouped work: the (token, expert) pairs are sorted by expert, each
expert multiplies its contiguous slice, and the weighted results are summed back per
token in expert order (the order transformers adds them in). Two ways to group:

 on the host    `grouped_experts`: the ids are read to the host, which slices per
                expert and calls each expert's linears (the CPU kernels' path: their
                packed weights, decode and prompt rows split per expert).
 on the device  `StackedExperts`: every expert's weights in two stacked tensors, the
                sort, counts and slice offsets computed by torch ops, one grouped
                matmul per projection (torch kernels: CUDA, and the CPU fallback). No
                host read, so a CUDA graph can capture it.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import replace

import torch

from laneserve.distributed.expert_parallel import NO_EXPERTS, ExpertParallel
from laneserve.distributed.parallel_state import SINGLE, TensorParallel
from laneserve.kernels import Kernels
from laneserve.kernels.quant import cat_rows
from laneserve.kernels.reference import LAYOUT_TORCH
from laneserve.model.arch import DeepseekParams
from laneserve.model.layers.expert_exchange import ExpertExchange
from laneserve.model.layers.expert_groups import ExpertFn, combine, plan_pairs
from laneserve.model.layers.linear import Linear, LinearWeight, linear_weight
from laneserve.model.layers.mlp import GatedMLP
from laneserve.model.layers.parallel_blocks import expert_shards, gated_mlp_shard
from laneserve.model.layers.weights import WeightGetter

log = logging.getLogger(__name__)


def route(
    logits: torch.Tensor,  # [T, E] fp32
    bias: torch.Tensor | None,  # [E] fp32 (noaux_tc)
    p: DeepseekParams,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, k] fp32, expert ids [T, k]
    n, e = logits.shape
    if p.topk_method == "noaux_tc":
        scores = logits.sigmoid()
        assert bias is not None, "noaux_tc routing has a score-correction bias"
        choice = scores + bias
        groups = choice.view(n, p.n_group, e // p.n_group).topk(2, dim=-1)[0].sum(dim=-1)
        choice = _mask_groups(choice, groups, p, float("-inf"))
        ids = torch.topk(choice, k=p.num_experts_per_tok, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
    else:
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        if p.topk_method == "group_limited_greedy":
            groups = scores.view(n, p.n_group, e // p.n_group).max(dim=-1).values
            scores = _mask_groups(scores, groups, p, 0.0)
        weights, ids = torch.topk(scores, k=p.num_experts_per_tok, dim=-1, sorted=False)
    if p.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * p.routed_scaling_factor, ids


def _mask_groups(
    scores: torch.Tensor, group_scores: torch.Tensor, p: DeepseekParams, fill: float
) -> torch.Tensor:
    keep = torch.topk(group_scores, k=p.topk_group, dim=-1, sorted=False)[1]
    n, g = group_scores.shape
    drop = torch.ones((n, g), dtype=torch.bool, device=scores.device).scatter_(1, keep, False)
    # one masked_fill over the [T, G, E / G] view: no expanded mask copy, no negation
    return scores.view(n, g, -1).masked_fill(drop[:, :, None], fill).view(scores.shape)


class MoE:
    """Routed experts plus shared experts. With tensor parallelism (`tp`) a rank holds a
    slice of every expert's features (`parallel_blocks.expert_shards`) and of the shared
    experts; the router is replicated. Its routed and shared partial sums are added
    locally, then all-reduced once (docs/distributed.md). With expert parallelism (`ep`)
    a rank holds its share of the routed experts whole (`expert_exchange.py`)."""

    def __init__(
        self,
        p: DeepseekParams,
        kernels: Kernels,
        get: WeightGetter,
        prefix: str,
        tp: TensorParallel = SINGLE,
        ep: ExpertParallel = NO_EXPERTS,
    ) -> None:
        self.p, self.tp = p, tp
        # NOTE: the router stays in fp32 whatever the run dtype (as transformers keeps it)
        self.gate = get(f"{prefix}.gate.weight", torch.float32)  # [E, H]
        self.bias = None
        if p.topk_method == "noaux_tc":
            self.bias = get(f"{prefix}.gate.e_score_correction_bias", torch.float32)
        x = f"{prefix}.experts"
        # per expert: gate and up rows fused (one matmul), then down; through the kernels,
        # which keep bf16 (and resident fp8) weights as they are, accumulating in fp32 on CPU
        w13: Sequence[LinearWeight]
        w2: Sequence[LinearWeight]
        self.local = ep.experts(p.n_routed_experts)  # the routed experts this rank holds
        if tp.size == 1:
            w13 = [fused(get, f"{x}.{i}", ("gate_proj", "up_proj")) for i in self.local]
            w2 = [linear_weight(get, f"{x}.{i}.down_proj.weight") for i in self.local]
        else:
            w13, w2 = expert_shards(get, x, p.n_routed_experts, p.moe_intermediate_size, tp)
        self.w13 = [Linear(kernels, w, None) for w in w13]
        self.w2 = [Linear(kernels, w, None) for w in w2]
        self.kernels = kernels
        self.exchange = None
        self.stacked = None
        if ep.size > 1:
            self.exchange = ExpertExchange(ep, p.n_routed_experts, self._expert)
        else:
            self.stacked = StackedExperts.build(kernels, self.w13, self.w2)
        self.shared = None
        if p.n_shared_experts:
            self.shared = _shared_experts(p, kernels, get, f"{prefix}.shared_experts", tp)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        logits = x.float() @ self.gate.t()
        weights, ids = route(logits, self.bias, self.p)
        out = self.experts(x, weights, ids)
        if self.shared is not None:
            out.add_(self.shared(x))
        return self.tp.all_reduce(out)  # one reduction of both partial sums (N > 1)

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.stacked is not None:
            return self.stacked(x, weights, ids)
        if self.exchange is not None:
            return self.exchange(x, weights, ids)
        return grouped_experts(x, weights, ids, self._expert)

    def _expert(self, e: int, xs: torch.Tensor, _: int | None) -> torch.Tensor:
        i = e - self.local.start
        return self.w2[i](self.kernels.silu_and_mul(self.w13[i](xs)))

    def idle(self, dtype: torch.dtype, device: torch.device) -> None:
        """Expert parallelism: take part in this layer's exchange with no tokens."""
        assert self.exchange is not None, "only an expert-parallel layer exchanges"
        self.exchange.idle(self.gate.shape[1], dtype, device)


def _shared_experts(
    p: DeepseekParams, kernels: Kernels, get: WeightGetter, s: str, tp: TensorParallel
) -> GatedMLP:
    if tp.size > 1:  # features of all the shared experts, side by side in the checkpoint
        inter = p.moe_intermediate_size * p.n_shared_experts
        return gated_mlp_shard(kernels, get, s, inter, "shared experts' intermediate size", tp)
    gate_up = fused(get, s, ("gate_proj", "up_proj"))
    return GatedMLP(kernels, gate_up, linear_weight(get, f"{s}.down_proj.weight"))


def fused(get: WeightGetter, stem: str, names: Sequence[str]) -> LinearWeight:
    """`<stem>.<name>.weight` for each name, concatenated along N (kept quantized where
    the getter keeps them so: `linear_weight`)."""
    return cat_rows([linear_weight(get, f"{stem}.{n}.weight") for n in names])


def grouped_experts(
    x: torch.Tensor,  # [T, H]
    weights: torch.Tensor,  # [T, k] routing weights
    ids: torch.Tensor,  # [T, k] chosen experts
    expert: ExpertFn,
    first_prefill: int | None = None,  # tokens [first_prefill, T) are prompt tokens
) -> torch.Tensor:  # [T, H]
    """Run each expert once on its (token, slot) rows, weight them, and sum each token's k
    results in expert order. An expert's rows keep the step's token order, so its decode
    rows come before its prompt rows and `expert` gets the index of its first prompt row
    (None: no split asked for)."""
    plan = plan_pairs(ids)
    xs = x.index_select(0, torch.tensor(plan.tokens, dtype=torch.int64, device=x.device))
    outs, row = [], 0
    for e, n in plan.counts:
        first = None
        if first_prefill is not None:
            first = bisect_left(plan.tokens, first_prefill, row, row + n) - row
        outs.append(expert(e, xs[row : row + n], first))
        row += n
    y = outs[0] if len(outs) == 1 else torch.cat(outs)
    return combine(y, weights, plan)


class StackedExperts:
    """Routed experts grouped on the device: w13 [E, 2I, H] (gate rows, then up) and
    w2 [E, H, I], each expert's rows multiplied by one `torch._grouped_mm` per projection
    over slice offsets computed on the device. The same per-expert products and the same
    summation order as `grouped_experts` (bit-identical in fp32 on CPU)."""

    def __init__(
        self, kernels: Kernels, w13: torch.Tensor, w2: torch.Tensor, limit: float | None = None
    ) -> None:
        self.kernels, self.w13, self.w2, self.limit = kernels, w13, w2, limit

    @classmethod
    def build(
        cls,
        kernels: Kernels,
        w13: Sequence[Linear],
        w2: Sequence[Linear],
        limit: float | None = None,
    ) -> StackedExperts | None:
        """Stacked from the experts' dense linears, for the torch kernels; None (group on
        the host) for the CPU kernels, quantized experts, or where the device's grouped
        matmul refuses these shapes and dtype (checked once, on one row)."""
        if kernels.name != "torch" or any(w.weight.layout != LAYOUT_TORCH for w in (*w13, *w2)):
            return None
        stacked = cls(kernels, _stack(w13), _stack(w2), limit)
        try:
            stacked.probe()
        except RuntimeError as e:
            log.info("experts grouped on the host (the grouped matmul refused: %s)", e)
            return None
        return stacked

    def probe(self) -> None:
        """One token through expert 0 (raises where `_grouped_mm` does not run)."""
        x = torch.zeros((1, self.w13.shape[2]), dtype=self.w13.dtype, device=self.w13.device)
        ids = torch.zeros((1, 1), dtype=torch.int64, device=x.device)
        self(x, torch.ones((1, 1), device=x.device), ids)

    def __call__(
        self,
        x: torch.Tensor,  # [T, H]
        weights: torch.Tensor,  # [T, k] routing weights (fp32)
        ids: torch.Tensor,  # [T, k] chosen experts
    ) -> torch.Tensor:  # [T, H]
        t, k = ids.shape
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)  # pairs by expert, token order within one
        offsets = _expert_offsets(flat, self.w13.shape[0])
        xs = x.index_select(0, order // k).to(self.w13.dtype)
        h = torch._grouped_mm(xs, self.w13.transpose(1, 2), offs=offsets)
        act = self.kernels.silu_and_mul(h, self.limit)
        y = torch._grouped_mm(act, self.w2.transpose(1, 2), offs=offsets).to(x.dtype)
        y = y * weights.flatten().index_select(0, order)[:, None].to(x.dtype)
        # each token's k rows in the sorted order, ascending: its experts in expert order
        rank = torch.empty_like(order).scatter_(0, order, torch.arange(t * k, device=x.device))
        by_token = rank.view(t, k).sort(dim=1).values.flatten()
        return y.index_select(0, by_token).view(t, k, -1).sum(dim=1)


def _stack(linears: Sequence[Linear]) -> torch.Tensor:
    """[E, N, K]: the linears' weights stacked; each linear then holds a view of its slice
    (one copy of the weights in memory, the host path still usable)."""
    stacked = torch.stack([w.weight.data for w in linears])
    for w, data in zip(linears, stacked, strict=True):
        w.weight = replace(w.weight, data=data)
    return stacked


def _expert_offsets(flat: torch.Tensor, experts: int) -> torch.Tensor:
    """[E] int32: the end of each expert's slice in the expert-sorted pairs (fixed shape:
    a scatter-add count, not bincount, whose output size depends on the values)."""
    ones = torch.ones_like(flat, dtype=torch.int32)
    counts = torch.zeros(experts, dtype=torch.int32, device=flat.device)
    return counts.scatter_add_(0, flat, ones).cumsum(0, dtype=torch.int32)
