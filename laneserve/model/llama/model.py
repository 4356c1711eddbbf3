"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3): one file, same math.

Differences are config flags: Qwen2 has q/k/v biases, Qwen3 RMS-normalises q
and k per head before rotary. q/k/v and gate/up projections are fused at load
time (one matmul each). Inference only; weights are plain tensors taken from an
HF-named state dict.

With tensor parallelism (`tp`, docs/distributed.md) a rank holds its share of the heads
(q and kv alike: GQA groups stay whole), of the MLP's intermediate features and of the
vocabulary; o_proj and down_proj end in an all-reduce, the LM head in an all-gather.
"""

from __future__ import annotations

import torch

from laneserve.distributed.parallel_state import SINGLE, TensorParallel
from laneserve.kernels import Kernels
from laneserve.kernels.quant import cat_rows
from laneserve.kv_cache_interface import CacheGroupSpec
from laneserve.model.arch import ArchConfig
from laneserve.model.layers.attention import AttentionMetadata, paged_attention
from laneserve.model.layers.decoder_stack import DecoderStack
from laneserve.model.layers.linear import Linear, linear_weight
from laneserve.model.layers.mlp import GatedMLP
from laneserve.model.layers.norm import RMSNorm
from laneserve.model.layers.parallel import (
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_weight,
    load_shard,
    row_weight,
)
from laneserve.model.layers.rope import Rotary
from laneserve.model.layers.weights import WeightGetter


class DecoderLayer:
    def __init__(
        self,
        arch: ArchConfig,
        kernels: Kernels,
        get: WeightGetter,
        prefix: str,
        rotary: Rotary,
        quantize: str | None = None,  # weight-only quantization of the linears (MTP head)
        tp: TensorParallel = SINGLE,
    ) -> None:
        self.arch = arch
        self.kernels = kernels
        self.rotary = rotary
        self.num_heads = arch.num_heads // tp.size  # this rank's
        self.num_kv_heads = arch.num_kv_heads // tp.size
        a = f"{prefix}.self_attn"
        if tp.size == 1:
            self._load_attention(get, a, quantize)
            gate_up = cat_rows(
                [linear_weight(get, f"{prefix}.mlp.{x}_proj.weight") for x in ("gate", "up")]
            )
            self.mlp = GatedMLP(
                kernels, gate_up, linear_weight(get, f"{prefix}.mlp.down_proj.weight"), quantize
            )
        else:
            self._load_attention_shard(get, a, tp)
            self.mlp = _mlp_shard(arch, kernels, get, f"{prefix}.mlp", tp)
        self.q_norm = self.k_norm = None
        if arch.qk_norm:
            self.q_norm = RMSNorm(kernels, get(f"{a}.q_norm.weight"), arch.rms_norm_eps)
            self.k_norm = RMSNorm(kernels, get(f"{a}.k_norm.weight"), arch.rms_norm_eps)
        self.input_norm = RMSNorm(
            kernels, get(f"{prefix}.input_layernorm.weight"), arch.rms_norm_eps
        )
        self.post_norm = RMSNorm(
            kernels, get(f"{prefix}.post_attention_layernorm.weight"), arch.rms_norm_eps
        )
        self.q_size = self.num_heads * arch.head_dim
        self.kv_size = self.num_kv_heads * arch.head_dim
        self.scale = arch.head_dim**-0.5

    def _load_attention(self, get: WeightGetter, a: str, quantize: str | None) -> None:
        qkv_w = cat_rows([linear_weight(get, f"{a}.{x}_proj.weight") for x in "qkv"])
        qkv_b = None
        if self.arch.qkv_bias:
            qkv_b = torch.cat(
                [get(f"{a}.q_proj.bias"), get(f"{a}.k_proj.bias"), get(f"{a}.v_proj.bias")]
            )
        self.qkv = Linear(self.kernels, qkv_w, qkv_b, quantize)
        o_proj = linear_weight(get, f"{a}.o_proj.weight")
        self.o_proj: Linear | RowParallelLinear = Linear(self.kernels, o_proj, None, quantize)

    def _load_attention_shard(self, get: WeightGetter, a: str, tp: TensorParallel) -> None:
        """This rank's heads: q, k and v rows of them (column), o_proj columns (row)."""
        arch, hd = self.arch, self.arch.head_dim
        heads = {"q": (arch.num_heads, "attention heads")}
        heads["k"] = heads["v"] = (arch.num_kv_heads, "key/value heads")
        parts = [(f"{a}.{x}_proj.weight", n, hd, what) for x, (n, what) in heads.items()]
        qkv_b = None
        if arch.qkv_bias:
            biases = [(f"{a}.{x}_proj.bias", n, hd, what) for x, (n, what) in heads.items()]
            qkv_b = column_weight(get, biases, tp)
        self.qkv = Linear(self.kernels, column_weight(get, parts, tp), qkv_b)
        o_proj = row_weight(get, f"{a}.o_proj.weight", arch.num_heads, hd, "attention heads", tp)
        self.o_proj = RowParallelLinear(Linear(self.kernels, o_proj, None), tp)

    def __call__(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,  # [T, H], normed input of this layer
        residual: torch.Tensor,  # [T, H], updated in place
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        attn = self.attention(positions, hidden, kv_cache, meta)
        self.post_norm.add_(attn, residual)
        return self.mlp(attn, meta.num_decode_tokens)

    def attention(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        arch, t = self.arch, x.shape[0]
        # rows from meta.num_decode_tokens on are prompt chunks (Kernels.linear)
        qkv = self.qkv(x, meta.num_decode_tokens)  # [T, q_size + 2 * kv_size]
        qs, kvs = self.q_size, self.kv_size
        # NOTE: strided column views of qkv: the kernels take any row stride.
        q, k, v = qkv[:, :qs], qkv[:, qs : qs + kvs], qkv[:, qs + kvs :]
        if self.q_norm is not None and self.k_norm is not None:  # both or neither
            q = self.q_norm(q.reshape(-1, arch.head_dim)).view(t, qs)
            k = self.k_norm(k.reshape(-1, arch.head_dim)).view(t, kvs)
        self.rotary(positions, q, k)
        out = paged_attention(
            self.kernels,
            q.view(t, self.num_heads, arch.head_dim),
            k.view(t, self.num_kv_heads, arch.head_dim),
            v.view(t, self.num_kv_heads, arch.head_dim),
            kv_cache,
            meta,
            self.scale,
        )
        return self.o_proj(out.view(t, self.q_size), meta.num_decode_tokens)


class LlamaModel(DecoderStack):
    """forward(ids, positions, meta, caches) -> (normed hidden, pre-norm hidden)."""

    # Step inputs are complete host snapshots resolved on the device: step N+1
    # can be prepared while step N runs.
    supports_async_prepare = True

    def __init__(
        self,
        arch: ArchConfig,
        kernels: Kernels,
        get: WeightGetter,
        device: torch.device,
        act_dtype: torch.dtype,
        max_positions: int,
        tp: TensorParallel = SINGLE,  # this rank's view of its tensor-parallel group
    ) -> None:
        self.arch = arch
        self.kernels = kernels
        self.act_dtype = act_dtype
        rotary = Rotary(kernels, arch.inv_freq(), max_positions, arch.head_dim, device, act_dtype)
        self.layers = [
            DecoderLayer(arch, kernels, get, f"model.layers.{i}", rotary, tp=tp)
            for i in range(arch.num_layers)
        ]
        self.norm = RMSNorm(kernels, get("model.norm.weight"), arch.rms_norm_eps)
        if tp.size == 1:
            self.embed_tokens = get("model.embed_tokens.weight")  # [V, H], weight dtype
            tied = self.embed_tokens if arch.tie_word_embeddings else None
            self.lm_head = Linear(kernels, linear_weight(get, "lm_head.weight", tied), None)
        else:
            self._load_vocab_shard(get, tp)

    def _load_vocab_shard(self, get: WeightGetter, tp: TensorParallel) -> None:
        """This rank's vocabulary rows of the embedding and the LM head (tied: the same)."""
        start, n = tp.split(self.arch.vocab_size, "vocabulary size")
        self.embed_tokens = load_shard(get, "model.embed_tokens.weight", 0, start, n)
        self.vocab_embed = VocabParallelEmbedding(self.embed_tokens, start, tp)
        tied = self.arch.tie_word_embeddings
        head = self.embed_tokens if tied else load_shard(get, "lm_head.weight", 0, start, n)
        self.lm_head = ParallelLMHead(self.kernels, head, tp)


def _mlp_shard(
    arch: ArchConfig, kernels: Kernels, get: WeightGetter, m: str, tp: TensorParallel
) -> GatedMLP:
    """This rank's intermediate features: gate | up rows (merged column), down columns (row)."""
    inter, what = arch.intermediate_size, "intermediate size"
    parts = [(f"{m}.{x}_proj.weight", inter, 1, what) for x in ("gate", "up")]
    down = row_weight(get, f"{m}.down_proj.weight", inter, 1, what, tp)
    mlp = GatedMLP(kernels, column_weight(get, parts, tp), down)
    mlp.down = RowParallelLinear(mlp.down, tp)  # type: ignore[assignment]
    return mlp


def parallel_sizes(arch: ArchConfig) -> dict[str, int]:
    """What tensor parallelism splits, by name: each must divide by the TP size."""
    return {
        "attention heads": arch.num_heads,
        "key/value heads": arch.num_kv_heads,
        "intermediate size": arch.intermediate_size,
        "vocabulary size": arch.vocab_size,
    }


def cache_groups(
    arch: ArchConfig, block_size: int, dtype_bytes: int, mtp_layers: int, tp_size: int = 1
) -> list[CacheGroupSpec]:
    """K and V per token and layer (a rank: of its kv heads); the MTP head's layer gets a
    group of its own."""

    def group(name: str, layers: int) -> CacheGroupSpec:
        shape = (arch.num_kv_heads // tp_size, arch.head_dim)
        return CacheGroupSpec(name, "full_attention", block_size, layers, 2, shape, dtype_bytes)

    groups = [group("main", arch.num_layers)]
    if mtp_layers:
        groups.append(group("mtp", mtp_layers))
    return groups


def weight_shapes(arch: ArchConfig) -> dict[str, tuple[int, ...]]:
    """Expected shapes of the tensors config.json determines (checked at load)."""
    h, q = arch.hidden_size, arch.num_heads * arch.head_dim
    kv, inter = arch.num_kv_heads * arch.head_dim, arch.intermediate_size
    shapes = {"model.embed_tokens.weight": (arch.vocab_size, h), "model.norm.weight": (h,)}
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    mtp = f"model.layers.{arch.num_layers}"
    shapes[f"{mtp}.eh_proj.weight"] = (h, 2 * h)
    shapes[f"{mtp}.enorm.weight"] = shapes[f"{mtp}.hnorm.weight"] = (h,)
    for i in range(arch.num_layers + 1):  # the last one is the MTP head's decoder layer
        p = f"model.layers.{i}"
        shapes.update(
            {
                f"{p}.self_attn.q_proj.weight": (q, h),
                f"{p}.self_attn.k_proj.weight": (kv, h),
                f"{p}.self_attn.v_proj.weight": (kv, h),
                f"{p}.self_attn.o_proj.weight": (h, q),
                f"{p}.mlp.gate_proj.weight": (inter, h),
                f"{p}.mlp.up_proj.weight": (inter, h),
                f"{p}.mlp.down_proj.weight": (h, inter),
                f"{p}.input_layernorm.weight": (h,),
                f"{p}.post_attention_layernorm.weight": (h,),
            }
        )
    return shapes
