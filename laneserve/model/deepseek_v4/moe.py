"""DeepSeek V4 mixture of experts: `sqrtsoftplus` scores, learned or hash routing,
SwiGLU clamped at `swiglu_limit`, and one shared expert.

Routing runs in fp32. A `moe` layer picks the top-k experts by score + bias (the bias
only selects); a `hash_moe` layer takes them from `tid2eid[token id]`. Either way the
weights are the chosen experts' unbiased scores, normalised to sum to 1, times
`routed_scaling_factor`. Experts run grouped by expert (on the host or the device, as
in `layers/moe.py`), results summed per token in expert order (as transformers adds them).
Under tensor parallelism a rank holds every expert's share of the features
(`deepseek_v4/parallel.py`) and all-reduces routed + shared once per layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from laneserve.distributed.expert_parallel import NO_EXPERTS, ExpertParallel
from laneserve.distributed.parallel_state import SINGLE, TensorParallel
from laneserve.kernels import Kernels
from laneserve.model.arch import UnsupportedModelError
from laneserve.model.deepseek_v4.config import DeepseekV4Params
from laneserve.model.deepseek_v4.parallel import FEATURES, cols, rows
from laneserve.model.layers.expert_exchange import ExpertExchange
from laneserve.model.layers.linear import Linear, linear_weight
from laneserve.model.layers.moe import StackedExperts, fused, grouped_experts
from laneserve.model.layers.weights import WeightGetter

_SCORES = {
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda x: x.softmax(dim=-1),
}


class _Expert:
    """One SwiGLU expert; under tensor parallelism this rank's features of it: w1 / w3
    rows, w2 columns (its output is a partial sum)."""

    def __init__(
        self,
        kernels: Kernels,
        get: WeightGetter,
        stem: str,
        p: DeepseekV4Params,
        tp: TensorParallel,
    ) -> None:
        inter = p.moe_intermediate_size
        if tp.size == 1:  # kept as stored (fp8 / fp4) where the getter keeps them so
            self.w13 = Linear(kernels, fused(get, stem, ("w1", "w3")), None)
            self.w2 = Linear(kernels, linear_weight(get, f"{stem}.w2.weight"), None)
        else:
            w1, w3 = (rows(get, f"{stem}.{w}.weight", inter, 1, FEATURES, tp) for w in ("w1", "w3"))
            self.w13 = Linear(kernels, torch.cat([w1, w3]), None)
            self.w2 = Linear(kernels, cols(get, f"{stem}.w2.weight", inter, 1, FEATURES, tp), None)
        self.kernels, self.limit = kernels, p.swiglu_limit

    def __call__(self, x: torch.Tensor, first_prefill: int | None = None) -> torch.Tensor:
        h = self.kernels.silu_and_mul(self.w13(x, first_prefill), self.limit)
        return self.w2(h, first_prefill)


class V4MoE:
    def __init__(
        self,
        p: DeepseekV4Params,
        kernels: Kernels,
        get: WeightGetter,
        prefix: str,
        hashed: bool,
        tp: TensorParallel = SINGLE,
        ep: ExpertParallel = NO_EXPERTS,
    ) -> None:
        if p.scoring_func not in _SCORES:
            raise UnsupportedModelError(f"V4 scoring_func {p.scoring_func!r} is not supported")
        self.p, self.score, self.tp = p, _SCORES[p.scoring_func], tp
        self.gate = get(f"{prefix}.gate.weight", torch.float32)  # [E, H]
        self.bias = None if hashed else get(f"{prefix}.gate.bias", torch.float32)
        self.tid2eid = get(f"{prefix}.gate.tid2eid", torch.int64) if hashed else None
        self.local = ep.experts(p.n_routed_experts)  # the routed experts this rank holds
        self.experts = [_Expert(kernels, get, f"{prefix}.experts.{e}", p, tp) for e in self.local]
        self.shared = _Expert(kernels, get, f"{prefix}.shared_experts", p, tp)
        self.exchange = None
        self.stacked = None
        if ep.size > 1:  # NOTE: routing stays here, so hash routing reads this rank's ids
            self.exchange = ExpertExchange(ep, p.n_routed_experts, self._expert)
        else:
            w13, w2 = [e.w13 for e in self.experts], [e.w2 for e in self.experts]
            self.stacked = StackedExperts.build(kernels, w13, w2, p.swiglu_limit)

    def route(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.score(F.linear(x.float(), self.gate))  # [T, E]
        if self.tid2eid is not None:
            chosen = self.tid2eid.index_select(0, ids)  # [T, k]
        else:
            assert self.bias is not None
            k = self.p.num_experts_per_tok
            chosen = torch.topk(scores + self.bias, k, dim=-1, sorted=False).indices
        weights = scores.gather(1, chosen)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.p.routed_scaling_factor, chosen

    def __call__(
        self,
        x: torch.Tensor,  # [T, H]
        ids: torch.Tensor,
        first_prefill: int | None = None,  # tokens [first_prefill, T) are prompt tokens
    ) -> torch.Tensor:
        weights, chosen = self.route(x, ids)
        if self.stacked is not None:
            routed = self.stacked(x, weights, chosen)
        elif self.exchange is not None:
            routed = self.exchange(x, weights, chosen, first_prefill)
        else:
            routed = grouped_experts(x, weights, chosen, self._expert, first_prefill)
        # one all-reduce (a no-op on one rank) of this rank's routed + shared partial sums
        return self.tp.all_reduce(routed + self.shared(x, first_prefill))

    def _expert(self, e: int, rows: torch.Tensor, first: int | None) -> torch.Tensor:
        return self.experts[e - self.local.start](rows, first)

    def idle(self, dtype: torch.dtype, device: torch.device) -> None:
        """Expert parallelism: take part in this layer's exchange with no tokens."""
        assert self.exchange is not None, "only an expert-parallel layer exchanges"
        self.exchange.idle(self.gate.shape[1], dtype, device)
