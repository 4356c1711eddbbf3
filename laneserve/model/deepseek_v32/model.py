"""DeepSeek V3.2 decoder (`DeepseekV32ForCausalLM`): DeepSeek V3 (`deepseek/model.py`)
whose attention is DeepSeek Sparse Attention (`attention.py`, `indexer.py`).

The cache has two groups: the MLA latents ("main", as V3) and the indexer keys
("indexer", one `index_head_dim` entry per token and layer). Its forward takes both
groups' metadata and caches (step kind PAGED_GROUPS, `model/interface.py`). Its MTP
layer (`mtp.py`) has two groups of its own in the same layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from laneserve.distributed.parallel_state import TensorParallel
from laneserve.kernels import Kernels
from laneserve.kv_cache_interface import FULL_ATTENTION, CacheGroupSpec
from laneserve.model.arch import ArchConfig
from laneserve.model.deepseek import model as deepseek
from laneserve.model.deepseek_v32.attention import SparseMlaAttention
from laneserve.model.deepseek_v32.config import IndexerParams
from laneserve.model.deepseek_v32.indexer import Indexer
from laneserve.model.interface import PAGED_GROUPS
from laneserve.model.layers.attention import AttentionMetadata
from laneserve.model.layers.mla import MlaAttention
from laneserve.model.layers.rope import MlaRotary
from laneserve.model.layers.weights import WeightGetter


def _indexer(arch: ArchConfig) -> IndexerParams:
    assert arch.indexer is not None, "not a DeepSeek V3.2 architecture"
    return arch.indexer


class DeepseekV32Layer(deepseek.DeepseekLayer):
    def attention(
        self,
        arch: ArchConfig,
        kernels: Kernels,
        get: WeightGetter,
        prefix: str,
        rotary: MlaRotary,
        tp: TensorParallel,
    ) -> Any:
        # NOTE: under tensor parallelism MLA splits its heads (layers/mla.py); the indexer
        # is whole on every rank: it sums its heads before its top-k, so every rank
        # selects the same tokens from the same (replicated) latent and indexer caches
        mla = MlaAttention(arch, kernels, get, prefix, rotary, tp)
        return SparseMlaAttention(mla, Indexer(arch, kernels, get, prefix, rotary))


class DeepseekV32Model(deepseek.DeepseekModel):
    """forward(ids, positions, (latent meta, indexer meta, ...), (latent caches, indexer
    caches, ...)) -> (normed hidden, pre-norm hidden)."""

    step_kind = PAGED_GROUPS
    decode_graph_kind = None  # its decode reads two groups: no graph buckets for it yet
    layer_class = DeepseekV32Layer

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: Any,  # per cache group: AttentionMetadata
        caches: Sequence[Any],  # per cache group, per layer
    ) -> tuple[torch.Tensor, torch.Tensor]:
        metas: tuple[AttentionMetadata, AttentionMetadata] = (meta[0], meta[1])
        per_layer = [(caches[0][i], caches[1][i]) for i in range(len(self.layers))]
        return super().forward(input_ids, positions, metas, per_layer)


def cache_groups(
    arch: ArchConfig, block_size: int, dtype_bytes: int, mtp_layers: int, tp_size: int = 1
) -> list[CacheGroupSpec]:
    """V3's latent group, then the indexer keys' group (one entry per token and layer);
    with an MTP layer, its own latent group (`mtp`) and indexer-key group
    (`mtp_indexer`) follow. All whole on every tensor-parallel rank (`tp_size`)."""
    main, *mtp = deepseek.cache_groups(arch, block_size, dtype_bytes, mtp_layers)
    groups = [main, _indexer_group("indexer", arch, block_size, dtype_bytes, arch.num_layers)]
    if mtp_layers:
        groups += [*mtp, _indexer_group("mtp_indexer", arch, block_size, dtype_bytes, mtp_layers)]
    return groups


def _indexer_group(
    name: str, arch: ArchConfig, block_size: int, dtype_bytes: int, layers: int
) -> CacheGroupSpec:
    entry = (1, _indexer(arch).index_head_dim)
    return CacheGroupSpec(name, FULL_ATTENTION, block_size, layers, 1, entry, dtype_bytes)


def weight_shapes(arch: ArchConfig) -> dict[str, tuple[int, ...]]:
    """V3's shapes and every layer's indexer (MTP layers included, as released)."""
    ip, p, h = _indexer(arch), arch.deepseek, arch.hidden_size
    assert p is not None and p.q_lora_rank is not None
    shapes = deepseek.weight_shapes(arch)
    for i in range(arch.num_layers + p.num_nextn_predict_layers):
        a = f"model.layers.{i}.self_attn.indexer"
        shapes[f"{a}.wq_b.weight"] = (ip.index_n_heads * ip.index_head_dim, p.q_lora_rank)
        shapes[f"{a}.wk.weight"] = (ip.index_head_dim, h)
        shapes[f"{a}.k_norm.weight"] = (ip.index_head_dim,)
        shapes[f"{a}.k_norm.bias"] = (ip.index_head_dim,)
        shapes[f"{a}.weights_proj.weight"] = (ip.index_n_heads, h)
    return shapes
