"""The DeepSeek V3.2 checkpoint's own multi-token-prediction layer as a draft head.

As released, `model.layers.{num_hidden_layers}` is V3's MTP layer (`enorm`, `hnorm`,
`eh_proj`, `shared_head.norm`; `model/deepseek/mtp.py` computes it) whose decoder block
is a V3.2 one: its attention is DeepSeek Sparse Attention with a lightning indexer of its
own (`self_attn.indexer.*`), run by the target's code (`DeepseekV32Layer`).

Like the target, the block reads two cache groups: its MLA latents (`mtp`) and its
indexer keys (`mtp_indexer`), one layer each, in the target's layouts
(`model.cache_groups`). Its step kind is PAGED_GROUPS: the proposer hands it both
groups' metadata and layer caches, in that order. Each draft query selects the
`index_topk` best of the positions the MTP layer has seen through its own indexer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from laneserve.kernels import Kernels
from laneserve.model.deepseek.model import DeepseekModel
from laneserve.model.deepseek.mtp import DeepseekMtpHead, load_deepseek_mtp
from laneserve.model.deepseek_v32.model import DeepseekV32Layer
from laneserve.model.interface import PAGED_GROUPS

if TYPE_CHECKING:
    from laneserve.model.loader import WeightStore


class DeepseekV32MtpHead(DeepseekMtpHead):
    step_kind = PAGED_GROUPS  # (latent meta, indexer meta) and (latent, keys) caches
    cache_groups = ("mtp", "mtp_indexer")
    layer_class = DeepseekV32Layer


def load_deepseek_v32_mtp(
    store: WeightStore,
    base: DeepseekModel,
    kernels: Kernels,
    draft_weights: str | None,
    quantize: str | None,
) -> DeepseekMtpHead:
    return load_deepseek_mtp(store, base, kernels, draft_weights, quantize, DeepseekV32MtpHead)
