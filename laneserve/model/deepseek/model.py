"""DeepSeek V2 / V3 decoder (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`).

Each layer: RMSNorm -> MLA (`layers/mla.py`) -> RMSNorm -> MLP; the first
`first_k_dense_replace` layers have a dense gated MLP, the others the routed
MoE with shared experts (`layers/moe.py`). The paged cache has one MLA latent group
(`cache_groups`). Inference only; weights come from an HF-named state dict
(release layout: one tensor per expert).

With tensor parallelism (`tp`, docs/distributed.md) a rank holds its share of the
attention heads (MLA: q_b / kv_b rows, o_proj columns; the latent cache is whole), of
every expert's and the dense MLP's features, and of the vocabulary; o_proj and each MLP
or MoE block end in one all-reduce, the LM head in an all-gather.
"""

from __future__ import annotations

from typing import Any

import torch

from laneserve.distributed.expert_parallel import NO_EXPERTS, ExpertParallel
from laneserve.distributed.parallel_state import SINGLE, TensorParallel
from laneserve.kernels import Kernels
from laneserve.kv_cache_interface import CacheGroupSpec
from laneserve.model.arch import ArchConfig, DeepseekParams
from laneserve.model.layers.attention import AttentionMetadata
from laneserve.model.layers.decoder_stack import DecoderStack
from laneserve.model.layers.linear import Linear, linear_weight
from laneserve.model.layers.mla import MlaAttention
from laneserve.model.layers.mlp import GatedMLP
from laneserve.model.layers.moe import MoE, fused
from laneserve.model.layers.norm import RMSNorm
from laneserve.model.layers.parallel_blocks import ReducedMLP, gated_mlp_shard, vocab_shard
from laneserve.model.layers.rope import MlaRotary
from laneserve.model.layers.weights import WeightGetter

LayerCache = tuple[torch.Tensor, ...]


def _params(arch: ArchConfig) -> DeepseekParams:
    assert arch.deepseek is not None, "not a DeepSeek-layout architecture"
    return arch.deepseek


class DeepseekLayer:
    def __init__(
        self,
        arch: ArchConfig,
        kernels: Kernels,
        get: WeightGetter,
        prefix: str,
        rotary: MlaRotary,
        dense: bool,
        tp: TensorParallel = SINGLE,
        ep: ExpertParallel = NO_EXPERTS,
    ) -> None:
        eps = arch.rms_norm_eps
        self.attn = self.attention(arch, kernels, get, prefix, rotary, tp)
        m = f"{prefix}.mlp"
        self.mlp: GatedMLP | ReducedMLP | MoE
        if dense and tp.size > 1:
            what = "intermediate size"
            mlp = gated_mlp_shard(kernels, get, m, arch.intermediate_size, what, tp)
            self.mlp = ReducedMLP(mlp, tp)
        elif dense:
            gate_up = fused(get, m, ("gate_proj", "up_proj"))
            self.mlp = GatedMLP(kernels, gate_up, linear_weight(get, f"{m}.down_proj.weight"))
        else:
            self.mlp = MoE(_params(arch), kernels, get, m, tp, ep)
        self.input_norm = RMSNorm(kernels, get(f"{prefix}.input_layernorm.weight"), eps)
        self.post_norm = RMSNorm(kernels, get(f"{prefix}.post_attention_layernorm.weight"), eps)

    def attention(
        self,
        arch: ArchConfig,
        kernels: Kernels,
        get: WeightGetter,
        prefix: str,
        rotary: MlaRotary,
        tp: TensorParallel,
    ) -> Any:  # called as (positions, hidden, cache, meta) -> [T, H]
        return MlaAttention(arch, kernels, get, prefix, rotary, tp)

    def __call__(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,  # [T, H] normed input of this layer
        residual: torch.Tensor,  # [T, H] updated in place
        cache: LayerCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        attn = self.attn(positions, hidden, cache, meta)
        self.post_norm.add_(attn, residual)
        return self.mlp(attn)


class DeepseekModel(DecoderStack):
    """forward(ids, positions, meta, caches) -> (normed hidden, pre-norm hidden)."""

    supports_async_prepare = True  # inputs are resolved on the device, as for Llama
    layer_class: type[DeepseekLayer] = DeepseekLayer

    def __init__(
        self,
        arch: ArchConfig,
        kernels: Kernels,
        get: WeightGetter,
        device: torch.device,
        act_dtype: torch.dtype,
        max_positions: int,
        tp: TensorParallel = SINGLE,  # this rank's view of its tensor-parallel group
        ep: ExpertParallel = NO_EXPERTS,  # ... and of its expert-parallel group
    ) -> None:
        p = _params(arch)
        self.arch, self.kernels, self.act_dtype, self.tp = arch, kernels, act_dtype, tp
        self.ep = ep
        self.rotary = MlaRotary(
            arch.rope_scaling or {"rope_theta": arch.rope_theta},
            p.qk_rope_head_dim,
            max_positions,
            p.rope_interleave,
            device,
            act_dtype,
        )
        self.layers = [
            self.layer_class(
                arch,
                kernels,
                get,
                f"model.layers.{i}",
                self.rotary,
                i < p.first_k_dense_replace,
                tp,
                ep,
            )
            for i in range(arch.num_layers)
        ]
        self.norm = RMSNorm(kernels, get("model.norm.weight"), arch.rms_norm_eps)
        tied = arch.tie_word_embeddings
        if tp.size > 1:
            self.embed_tokens, self.vocab_embed, self.lm_head = vocab_shard(
                kernels, get, arch.vocab_size, tied, tp
            )
            return
        self.embed_tokens = get("model.embed_tokens.weight")  # [V, H]
        head = self.embed_tokens if tied else get("lm_head.weight")
        self.lm_head = Linear(kernels, head, None)

    @property
    def moe_layers(self) -> list[MoE]:
        """The routed-expert blocks in forward order (expert parallelism's exchanges)."""
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoE)]


def cache_groups(
    arch: ArchConfig, block_size: int, dtype_bytes: int, mtp_layers: int, tp_size: int = 1
) -> list[CacheGroupSpec]:
    """One latent entry per token and layer; the MTP layers get a group of their own.
    The latent is per token, not per head: every tensor-parallel rank (`tp_size`) caches
    all of it."""
    p = _params(arch)

    def group(name: str, layers: int) -> CacheGroupSpec:
        return CacheGroupSpec(
            name, "full_attention", block_size, layers, 1, (1, p.latent_dim), dtype_bytes
        )

    groups = [group("main", arch.num_layers)]
    if mtp_layers:
        groups.append(group("mtp", mtp_layers))
    return groups


def parallel_sizes(arch: ArchConfig) -> dict[str, int]:
    """What tensor parallelism splits, by name: each must divide by the TP size."""
    p = _params(arch)
    sizes = {"attention heads": arch.num_heads, "vocabulary size": arch.vocab_size}
    if p.first_k_dense_replace:
        sizes["intermediate size"] = arch.intermediate_size
    if p.first_k_dense_replace < arch.num_layers + p.num_nextn_predict_layers:
        sizes["moe intermediate size"] = p.moe_intermediate_size
        if p.n_shared_experts:
            shared = p.moe_intermediate_size * p.n_shared_experts
            sizes["shared experts' intermediate size"] = shared
    return sizes


def weight_shapes(arch: ArchConfig) -> dict[str, tuple[int, ...]]:
    """Expected shapes of the tensors config.json determines (checked at load)."""
    p, h = _params(arch), arch.hidden_size
    heads, v = arch.num_heads, arch.vocab_size
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for i in range(arch.num_layers + p.num_nextn_predict_layers):
        a = f"model.layers.{i}.self_attn"
        shapes[f"{a}.kv_a_proj_with_mqa.weight"] = (p.latent_dim, h)
        shapes[f"{a}.kv_b_proj.weight"] = (
            heads * (p.qk_nope_head_dim + p.v_head_dim),
            p.kv_lora_rank,
        )
        shapes[f"{a}.o_proj.weight"] = (h, heads * p.v_head_dim)
        if p.q_lora_rank is None:
            shapes[f"{a}.q_proj.weight"] = (heads * p.qk_head_dim, h)
        else:
            shapes[f"{a}.q_a_proj.weight"] = (p.q_lora_rank, h)
            shapes[f"{a}.q_b_proj.weight"] = (heads * p.qk_head_dim, p.q_lora_rank)
        if i >= p.first_k_dense_replace:
            shapes[f"model.layers.{i}.mlp.gate.weight"] = (p.n_routed_experts, h)
    return shapes
