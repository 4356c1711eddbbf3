"""The DeepSeek checkpoint's own multi-token-prediction layer as a draft head.

`num_nextn_predict_layers` layers follow the last decoder layer in the checkpoint
(`model.layers.{num_hidden_layers}`); the first one drafts, reused for every depth:

    x  = eh_proj(concat(enorm(embed(t[i+1])), hnorm(h[i])))   # h: the final-normed hidden
    h' = shared_head.norm(block(x))                           # an MLA + MoE decoder layer
    draft(t[i+2]) = argmax lm_head(h')

The embedding and the LM head are the target's (the checkpoint's per-layer copies
`embed_tokens` / `shared_head.head` are the same tensors, as transformers shares
them). The block has its own MLA cache group. Under tensor parallelism the block is
sharded like the target's layers and every rank drafts the same tokens from the same
all-gathered logits. The head has the interface of
`model/llama/mtp.py`'s head, so the same proposer (`spec_decode/proposers.py`) runs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from laneserve.kernels import Kernels
from laneserve.model.arch import ArchConfig, UnsupportedModelError
from laneserve.model.deepseek.model import DeepseekLayer, DeepseekModel
from laneserve.model.interface import PAGED
from laneserve.model.layers.linear import Linear, linear_weight
from laneserve.model.layers.moe import MoE
from laneserve.model.layers.norm import RMSNorm
from laneserve.model.layers.weights import WeightGetter

if TYPE_CHECKING:
    from laneserve.model.loader import WeightStore


class DeepseekMtpHead:
    step_kind = PAGED  # its group's AttentionMetadata
    cache_groups: tuple[str, ...] = ("mtp",)
    layer_class: type[DeepseekLayer] = DeepseekLayer  # its decoder block

    def __init__(
        self, arch: ArchConfig, kernels: Kernels, get: WeightGetter, base: DeepseekModel
    ) -> None:
        p = arch.deepseek
        assert p is not None
        prefix = f"model.layers.{arch.num_layers}"
        eps = arch.rms_norm_eps
        self.base, self.kernels = base, kernels
        self.enorm = RMSNorm(kernels, get(f"{prefix}.enorm.weight"), eps)
        self.hnorm = RMSNorm(kernels, get(f"{prefix}.hnorm.weight"), eps)
        self.eh_proj = Linear(kernels, linear_weight(get, f"{prefix}.eh_proj.weight"), None)
        dense = arch.num_layers < p.first_k_dense_replace
        # sharded as the target's layers; eh_proj and the norms are whole on every rank
        self.layer = self.layer_class(
            arch, kernels, get, prefix, base.rotary, dense, base.tp, base.ep
        )
        self.norm = RMSNorm(kernels, get(f"{prefix}.shared_head.norm.weight"), eps)
        self.head = base.lm_head
        self.draft_vocab = None

    def forward(
        self,
        next_tokens: torch.Tensor,  # [T] t[i+1] for each position i
        hidden: torch.Tensor,  # [T, H] the target's (or the previous depth's) normed hidden
        positions: torch.Tensor,  # [T] i
        meta: Any,  # its group's AttentionMetadata (of its step kind)
        cache: Any,  # its group's (latent,) (of its step kind)
    ) -> torch.Tensor:  # [T, H] normed output (feeds the head and the next depth)
        e = self.enorm(self.base.embed(next_tokens))
        x = self.eh_proj(torch.cat([e, self.hnorm(hidden)], dim=-1))
        residual = x
        y = self.layer(positions, self.layer.input_norm(x), residual, cache, meta)
        self.norm.add_(y, residual)
        return y

    @property
    def moe_layers(self) -> list[MoE]:
        """Its routed-expert block, if any (expert parallelism's exchanges)."""
        return [self.layer.mlp] if isinstance(self.layer.mlp, MoE) else []

    def draft(self, normed: torch.Tensor, n: int = 1) -> torch.Tensor:  # [N, n] best first
        return self.kernels.top_tokens(self.head(normed), n, None)


def refuse_head_options(arch: ArchConfig, draft_weights: str | None, quantize: str | None) -> None:
    """A DeepSeek checkpoint drafts with its own layer, as stored."""
    if draft_weights:
        raise UnsupportedModelError(
            f"{arch.architecture}: the draft comes from the checkpoint's own MTP layer; "
            "separate draft_weights are not supported for this family"
        )
    if quantize:
        raise UnsupportedModelError(f"{arch.architecture}: MTP quantization is not supported")


def load_deepseek_mtp(
    store: WeightStore,
    base: DeepseekModel,
    kernels: Kernels,
    draft_weights: str | None,
    quantize: str | None,
    head_class: type[DeepseekMtpHead] = DeepseekMtpHead,
) -> DeepseekMtpHead:
    arch = store.ckpt.arch
    refuse_head_options(arch, draft_weights, quantize)
    name = f"model.layers.{arch.num_layers}.eh_proj.weight"
    assert arch.deepseek is not None, "a DeepSeek checkpoint"
    if not arch.deepseek.num_nextn_predict_layers or not store.has(name):
        raise UnsupportedModelError(
            f"{store.ckpt.source} carries no MTP layer ({name}; num_nextn_predict_layers="
            f"{arch.deepseek.num_nextn_predict_layers}): speculative method 'mtp' needs one; "
            'use "method": "ngram"'
        )
    return head_class(arch, kernels, store, base)
