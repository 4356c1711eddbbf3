"""DeepSeek V4 decoder (`DeepseekV4ForCausalLM`).

Per layer, around `hc_mult` residual streams (hyper-connections, `deepseek_v4/ops.py`):
attention of the layer's kind (sliding / CSA / HCA, `deepseek_v4/attention.py`), then
the MoE (`deepseek_v4/moe.py`); the streams are collapsed by `hc_head` before the final
norm and the LM head.

Weights: transformers' `save_pretrained` names (`model.layers.N.attn.wq_a.weight`,
`model.embed_tokens.weight`, `model.hc_head.hc_fn`, `head.weight`) or the release names
(no `model.` prefix, `embed.weight`, `hc_head_fn`).

With tensor parallelism (`tp`) a rank loads its slices (`deepseek_v4/parallel.py`):
query heads and output groups, every expert's features, vocabulary rows; a layer
costs two all-reduces (after wo_b, after the MoE), as a Llama layer does.

Cache groups (one block size in tokens; see docs/models.md for the picture):
```
 swa        sliding_window  every layer   K = V per token               keeps W
 csa_state  sliding_window  CSA layers    compressor projections/token  keeps 2m
 hca_state  sliding_window  HCA layers    compressor projections/token  keeps m'
 csa        compressed      CSA layers    entry + indexer entry per m tokens
 hca        compressed      HCA layers    entry per m' tokens
```
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from laneserve.distributed.expert_parallel import NO_EXPERTS, ExpertParallel
from laneserve.distributed.parallel_state import SINGLE, TensorParallel
from laneserve.kernels import Kernels
from laneserve.kv_cache_interface import CacheGroupSpec
from laneserve.model.arch import ArchConfig
from laneserve.model.deepseek_v4.attention import V4Attention
from laneserve.model.deepseek_v4.caches import LayerCaches
from laneserve.model.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Params
from laneserve.model.deepseek_v4.moe import V4MoE
from laneserve.model.deepseek_v4.ops import HyperConnection, HyperHead, InterleavedRope, Norm
from laneserve.model.deepseek_v4.parallel import VOCAB
from laneserve.model.interface import TOKEN_TABLES
from laneserve.model.layers.attention import TokenTableMetadata
from laneserve.model.layers.linear import Linear
from laneserve.model.layers.parallel import ParallelLMHead, VocabParallelEmbedding, load_shard
from laneserve.model.layers.weights import WeightGetter


def _params(arch: ArchConfig) -> DeepseekV4Params:
    assert arch.v4 is not None, "not a DeepSeek V4 architecture"
    return arch.v4


@dataclass(frozen=True)
class GroupPlan:
    name: str
    kind: str  # "sliding_window" or "compressed"
    layers: tuple[int, ...]  # model layers in the group, in order
    width: int  # values per entry
    tokens_per_entry: int
    window: int  # sliding_window: positions kept behind the newest (0: compressed)


def group_plan(p: DeepseekV4Params) -> list[GroupPlan]:
    d, di = p.head_dim, p.index_head_dim
    csa = tuple(i for i, t in enumerate(p.layer_types) if t == CSA)
    hca = tuple(i for i, t in enumerate(p.layer_types) if t == HCA)
    m, mh = p.rate(CSA), p.rate(HCA)
    plan = [
        GroupPlan("swa", "sliding_window", tuple(range(len(p.layer_types))), d, 1, p.sliding_window)
    ]
    if csa:
        plan.append(GroupPlan("csa_state", "sliding_window", csa, 4 * d + 4 * di, 1, 2 * m))
    if hca:
        plan.append(GroupPlan("hca_state", "sliding_window", hca, 2 * d, 1, mh))
    if csa:
        plan.append(GroupPlan("csa", "compressed", csa, d + di, m, 0))
    if hca:
        plan.append(GroupPlan("hca", "compressed", hca, d, mh, 0))
    return plan


class _Names:
    """Checkpoint names of either layout."""

    def __init__(self, get: WeightGetter) -> None:
        has = getattr(get, "has", None)
        self.release = has is not None and not has("model.embed_tokens.weight")
        self.root = "" if self.release else "model."

    def layer(self, i: int) -> str:
        return f"{self.root}layers.{i}"

    @property
    def embed(self) -> str:
        return "embed.weight" if self.release else "model.embed_tokens.weight"

    def hc_head(self, part: str) -> str:
        return f"hc_head_{part}" if self.release else f"model.hc_head.hc_{part}"


class V4Layer:
    def __init__(
        self,
        arch: ArchConfig,
        kernels: Kernels,
        get: WeightGetter,
        prefix: str,
        layer_type: str,
        hashed: bool,
        rope: InterleavedRope,
        tp: TensorParallel = SINGLE,
        ep: ExpertParallel = NO_EXPERTS,
    ) -> None:
        p, eps, a = _params(arch), arch.rms_norm_eps, f"{prefix}.attn"
        self.attn = V4Attention(p, kernels, get, a, layer_type, rope, eps, arch.num_heads, tp)
        self.ffn = V4MoE(p, kernels, get, f"{prefix}.ffn", hashed, tp, ep)
        self.attn_norm = Norm(get(f"{prefix}.attn_norm.weight", torch.float32), eps)
        self.ffn_norm = Norm(get(f"{prefix}.ffn_norm.weight", torch.float32), eps)
        n, it, he = p.hc_mult, p.hc_sinkhorn_iters, p.hc_eps
        self.hc_attn = HyperConnection(kernels, get, f"{prefix}.hc_attn", n, it, he, eps)
        self.hc_ffn = HyperConnection(kernels, get, f"{prefix}.hc_ffn", n, it, he, eps)

    def __call__(
        self,
        streams: torch.Tensor,  # [T, N, H]
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: LayerCaches,
        meta: TokenTableMetadata,
    ) -> torch.Tensor:
        post, comb, x = self.hc_attn(streams)
        out = self.attn(self.attn_norm(x), positions, cache, meta)
        streams = self.hc_attn.expand(post, comb, out, streams)
        post, comb, x = self.hc_ffn(streams)
        out = self.ffn(self.ffn_norm(x), ids, meta.first_prefill)
        return self.hc_ffn.expand(post, comb, out, streams)


class DeepseekV4Model:
    """forward(ids, positions, TokenTableMetadata, caches of every group) -> (normed hidden,
    the last layer's residual streams [T, N * H], which the MTP layer reads)."""

    supports_async_prepare = True  # inputs are resolved on the device, as for Llama
    step_kind = TOKEN_TABLES  # the runner passes every group's tables and caches
    decode_graph_kind = TOKEN_TABLES
    mtp_reads_second_output = True  # the MTP layer drafts from the residual streams

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
        self.arch, self.kernels, self.act_dtype, self.p, self.tp = arch, kernels, act_dtype, p, tp
        self.ep = ep
        names = _Names(get)
        ropes = {
            SLIDING: InterleavedRope(p.main_rope, p.rope_dim, max_positions, device),
            "compress": InterleavedRope(p.compress_rope, p.rope_dim, max_positions, device),
        }
        self.main_rope = ropes[SLIDING]  # the MTP layer's (sliding-window) attention uses it
        self.layers = [
            V4Layer(
                arch,
                kernels,
                get,
                names.layer(i),
                t,
                p.mlp_layer_types[i] == "hash_moe",
                ropes[SLIDING if t == SLIDING else "compress"],
                tp,
                ep,
            )
            for i, t in enumerate(p.layer_types)
        ]
        self.hc_head = HyperHead(
            get(names.hc_head("fn"), torch.float32),
            get(names.hc_head("base"), torch.float32),
            get(names.hc_head("scale"), torch.float32),
            p.hc_eps,
        )
        self.norm = Norm(get(f"{names.root}norm.weight", torch.float32), arch.rms_norm_eps)
        self._load_vocab(get, names.embed, tp)
        self.plan = group_plan(p)

    @property
    def moe_layers(self) -> list[V4MoE]:
        """The routed-expert blocks in forward order (expert parallelism's exchanges)."""
        return [layer.ffn for layer in self.layers]

    def _load_vocab(self, get: WeightGetter, embed: str, tp: TensorParallel) -> None:
        """The embedding and the head: whole, or this rank's vocabulary rows of them."""
        self.vocab_embed: VocabParallelEmbedding | None = None
        if tp.size == 1:
            self.embed_tokens = get(embed)
            self.lm_head: Linear | ParallelLMHead = Linear(self.kernels, get("head.weight"), None)
            return
        start, n = tp.split(self.arch.vocab_size, VOCAB)
        self.embed_tokens = load_shard(get, embed, 0, start, n)
        self.vocab_embed = VocabParallelEmbedding(self.embed_tokens, start, tp)
        self.lm_head = ParallelLMHead(self.kernels, load_shard(get, "head.weight", 0, start, n), tp)

    def layer_caches(self, caches: list[list[tuple[torch.Tensor, ...]]]) -> list[LayerCaches]:
        """Per model layer: its tensors in the groups it belongs to."""
        found: list[dict[str, tuple[torch.Tensor, int]]] = [{} for _ in self.layers]
        for g, plan in enumerate(self.plan):
            role = "swa" if plan.name == "swa" else plan.kind
            for j, layer in enumerate(plan.layers):
                found[layer][role] = (caches[g][j][0], g)
        out = []
        for f in found:
            swa, sg = f["swa"]
            state, stg = f.get("sliding_window", (None, -1))
            entries, eg = f.get("compressed", (None, -1))
            out.append(LayerCaches(swa, sg, state, stg, entries, eg))
        return out

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.vocab_embed is not None:  # this rank's rows, all-reduced
            return self.vocab_embed(input_ids).to(self.act_dtype)
        return F.embedding(input_ids, self.embed_tokens).to(self.act_dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: TokenTableMetadata,
        caches: list[list[tuple[torch.Tensor, ...]]],  # per group, per layer in it
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(input_ids)
        streams = x[:, None, :].expand(-1, self.p.hc_mult, -1).contiguous()
        for layer, cache in zip(self.layers, self.layer_caches(caches), strict=True):
            streams = layer(streams, input_ids, positions, cache, meta)
        collapsed = self.hc_head(streams, self.arch.rms_norm_eps)
        return self.norm(collapsed), streams.reshape(streams.shape[0], -1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, V] fp32
        return self.lm_head(hidden).float()


def cache_groups(
    arch: ArchConfig, block_size: int, dtype_bytes: int, mtp_layers: int, tp_size: int = 1
) -> list[CacheGroupSpec]:
    """The groups of `group_plan` (a compressed group's block holds `block_size` entries),
    then the MTP layer's sliding window of K = V entries. The same on every
    tensor-parallel rank (`tp_size`): the single K = V head, the compressors' state and
    the compressed entries are whole on each (`deepseek_v4/parallel.py`)."""
    p = _params(arch)
    groups = [
        CacheGroupSpec(
            g.name,
            g.kind,
            block_size * g.tokens_per_entry,
            len(g.layers),
            1,
            (1, g.width),
            dtype_bytes,
            tokens_per_entry=g.tokens_per_entry,
            window=g.window,
        )
        for g in group_plan(p)
    ]
    if mtp_layers:
        groups.append(
            CacheGroupSpec(
                "mtp",
                "sliding_window",
                block_size,
                mtp_layers,
                1,
                (1, p.head_dim),
                dtype_bytes,
                window=p.sliding_window,
            )
        )
    return groups


def weight_shapes(arch: ArchConfig) -> dict[str, tuple[int, ...]]:
    """Expected shapes of the tensors config.json determines, in both layouts."""
    p, h, v = _params(arch), arch.hidden_size, arch.vocab_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, h),
        "embed.weight": (v, h),
        "head.weight": (v, h),
    }
    for root in ("model.", ""):
        for i in range(len(p.layer_types)):
            a = f"{root}layers.{i}.attn"
            shapes[f"{a}.wq_a.weight"] = (p.q_lora_rank, h)
            shapes[f"{a}.wkv.weight"] = (p.head_dim, h)
            shapes[f"{a}.wq_b.weight"] = (arch.num_heads * p.head_dim, p.q_lora_rank)
            shapes[f"{a}.wo_a.weight"] = (
                p.o_groups * p.o_lora_rank,
                arch.num_heads * p.head_dim // p.o_groups,
            )
            shapes[f"{a}.wo_b.weight"] = (h, p.o_groups * p.o_lora_rank)
            shapes[f"{root}layers.{i}.ffn.gate.weight"] = (p.n_routed_experts, h)
    return shapes
