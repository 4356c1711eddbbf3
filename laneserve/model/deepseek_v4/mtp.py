"""The DeepSeek V4 checkpoint's own multi-token-prediction layer as a draft head.

Release checkpoints carry it as `mtp.0.*`. It reads the target's `hc_mult` residual
streams (the last layer's output, before `hc_head` collapses them) and keeps
streams of its own:

    x  = e_proj(enorm(embed(t[i+1])))  +  h_proj(hnorm(streams[i]))    (per stream)
    s' = block(x)             # a V4 layer: sliding-window attention, scored MoE, hyper-connections
    draft(t[i+2]) = argmax head(norm(hc_head'(s')))   # its own hc_head, the target's LM head

`s'` feeds the next depth, as the V3 layer's normed output does. The head's cache
group (`"mtp"`) is a sliding window of K = V entries, like the target's `swa` group.
Under tensor parallelism the block is split as the target's layers are (its heads,
output groups and expert features; `deepseek_v4/parallel.py`), e_proj / h_proj and the
norms are whole, and the embedding and head are the target's vocabulary-parallel ones.
The head has the interface of every draft head (`model/interface.py`'s `DraftHead`); its
step kind is `token_tables`: V4 attention reads a block table per token
(`interface.single_group_tables`), not the paged-attention metadata of the other families.
"""

from __future__ import annotations

import torch

from laneserve.kernels import Kernels
from laneserve.model.arch import ArchConfig, UnsupportedModelError
from laneserve.model.deepseek.mtp import refuse_head_options
from laneserve.model.deepseek_v4.caches import LayerCaches
from laneserve.model.deepseek_v4.config import SLIDING
from laneserve.model.deepseek_v4.model import DeepseekV4Model, V4Layer
from laneserve.model.deepseek_v4.moe import V4MoE
from laneserve.model.deepseek_v4.ops import HyperHead, Norm
from laneserve.model.interface import TOKEN_TABLES
from laneserve.model.layers.attention import TokenTableMetadata
from laneserve.model.layers.linear import Linear, linear_weight
from laneserve.model.layers.weights import WeightGetter

PREFIX = "mtp.0"


class DeepseekV4MtpHead:
    step_kind = TOKEN_TABLES  # its group's table per token (`interface.single_group_tables`)
    cache_groups = ("mtp",)

    def __init__(
        self,
        arch: ArchConfig,
        kernels: Kernels,
        get: WeightGetter,
        base: DeepseekV4Model,
    ) -> None:
        p, eps = base.p, arch.rms_norm_eps
        self.base, self.kernels, self.n, self.eps = base, kernels, p.hc_mult, eps
        self.enorm = Norm(get(f"{PREFIX}.enorm.weight", torch.float32), eps)
        self.hnorm = Norm(get(f"{PREFIX}.hnorm.weight", torch.float32), eps)
        self.e_proj = Linear(kernels, linear_weight(get, f"{PREFIX}.e_proj.weight"), None)
        self.h_proj = Linear(kernels, linear_weight(get, f"{PREFIX}.h_proj.weight"), None)
        rope = base.main_rope
        self.layer = V4Layer(arch, kernels, get, PREFIX, SLIDING, False, rope, base.tp, base.ep)
        self.hc_head = HyperHead(
            get(f"{PREFIX}.hc_head_fn", torch.float32),
            get(f"{PREFIX}.hc_head_base", torch.float32),
            get(f"{PREFIX}.hc_head_scale", torch.float32),
            p.hc_eps,
        )
        self.norm = Norm(get(f"{PREFIX}.norm.weight", torch.float32), eps)
        self.draft_vocab = None

    def forward(
        self,
        next_tokens: torch.Tensor,  # [T] t[i+1] for each position i
        hidden: torch.Tensor,  # [T, N * H] the target's (or the previous depth's) streams
        positions: torch.Tensor,  # [T] i
        meta: TokenTableMetadata,  # the MTP group's table per token (`single_group_tables`)
        cache: tuple[torch.Tensor, ...],  # the MTP group's (K = V,)
    ) -> torch.Tensor:  # [T, N * H] this depth's streams
        t = next_tokens.shape[0]
        e = self.e_proj(self.enorm(self.base.embed(next_tokens)))  # [T, H]
        streams = hidden.view(t, self.n, -1)
        h = self.h_proj(self.hnorm(streams).reshape(t * self.n, -1)).view(t, self.n, -1)
        x = e[:, None, :] + h
        out = self.layer(x, next_tokens, positions, LayerCaches(cache[0], 0), meta)
        return out.reshape(t, -1)

    def logits(self, streams: torch.Tensor) -> torch.Tensor:  # [N, V] fp32
        collapsed = self.hc_head(streams.view(streams.shape[0], self.n, -1), self.eps)
        return self.base.compute_logits(self.norm(collapsed))

    @property
    def moe_layers(self) -> list[V4MoE]:
        """Its routed-expert block (expert parallelism's exchanges)."""
        return [self.layer.ffn]

    def draft(self, streams: torch.Tensor, n: int = 1) -> torch.Tensor:  # [N, n] best first
        return self.kernels.top_tokens(self.logits(streams), n, None)


def load_deepseek_v4_mtp(
    store,  # WeightStore
    base: DeepseekV4Model,
    kernels: Kernels,
    draft_weights: str | None,
    quantize: str | None,
) -> DeepseekV4MtpHead:
    refuse_head_options(store.ckpt.arch, draft_weights, quantize)
    name = f"{PREFIX}.e_proj.weight"
    if not store.has(name):
        raise UnsupportedModelError(
            f"{store.ckpt.source} carries no MTP layer ({name}; the release layout's "
            '`mtp.0.*`): speculative method \'mtp\' needs one; use "method": "ngram"'
        )
    return DeepseekV4MtpHead(store.ckpt.arch, kernels, store, base)
