"""Architecture description parsed from an HF `config.json` dict.

One `ArchConfig` covers the Llama family (Llama, Mistral, Qwen2, Qwen3): the
same math switched by a few flags (q/k/v bias, q/k RMSNorm, tied embeddings,
rope scaling). The DeepSeek V2 / V3 family adds its MLA / MoE parameters in
`ArchConfig.deepseek` (`DeepseekParams`); V3.2 its indexer's in `ArchConfig.indexer`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from laneserve.model.deepseek_v4.config import DeepseekV4ConfigError, DeepseekV4Params
from laneserve.model.deepseek_v32.config import IndexerConfigError, IndexerParams

log = logging.getLogger(__name__)

# architectures value -> the flags that distinguish it
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
    "DeepseekV2ForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "DeepseekV3ForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "DeepseekV32ForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "DeepseekV4ForCausalLM": {"qkv_bias": False, "qk_norm": False},
}
DEEPSEEK_ARCHITECTURES = (
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM",
)
# GGUF general.architecture -> HF architectures value
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


class UnsupportedModelError(ValueError):
    """The checkpoint is readable but not a family laneserve can run."""


@dataclass(frozen=True)
class DeepseekParams:
    """MLA attention, routed MoE and MTP layers of the DeepSeek V2 / V3 layout."""

    q_lora_rank: int | None  # None: a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    n_shared_experts: int
    moe_intermediate_size: int
    first_k_dense_replace: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    topk_method: str  # "noaux_tc" (V3: sigmoid + bias), "greedy" / "group_limited_greedy" (V2)
    rope_interleave: bool
    num_nextn_predict_layers: int
    attention_bias: bool

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values per token in the paged cache: the normed latent, then the rotated rope part."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @staticmethod
    def from_hf(arch: str, cfg: dict) -> DeepseekParams:
        v3 = arch in ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")
        method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
        if method not in ("noaux_tc", "greedy", "group_limited_greedy"):
            raise UnsupportedModelError(f"{arch} with topk_method={method!r} is not supported")
        q_lora = cfg.get("q_lora_rank")
        return DeepseekParams(
            q_lora_rank=int(q_lora) if q_lora else None,
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
            qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
            v_head_dim=int(cfg["v_head_dim"]),
            n_routed_experts=int(cfg["n_routed_experts"]),
            num_experts_per_tok=int(cfg["num_experts_per_tok"]),
            n_group=int(cfg.get("n_group") or 1),
            topk_group=int(cfg.get("topk_group") or 1),
            n_shared_experts=int(cfg.get("n_shared_experts") or 0),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            # NOTE: transformers' V2 router never renormalises the top-k weights
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)) if v3 else False,
            topk_method=method,
            rope_interleave=bool(cfg.get("rope_interleave", True)),
            num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0),
            attention_bias=bool(cfg.get("attention_bias", False)),
        )


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    sliding_window: int | None = None
    deepseek: DeepseekParams | None = None
    v4: DeepseekV4Params | None = None  # DeepSeek V4 (its window is not a context cap)
    indexer: IndexerParams | None = None  # DeepSeek V3.2's sparse attention

    @staticmethod
    def from_hf(cfg: dict) -> ArchConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and "DeepseekV41ForCausalLM" in archs:
            raise UnsupportedModelError(_v41_refusal(cfg))
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"laneserve supports {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        flags = SUPPORTED_ARCHITECTURES[arch]
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"{arch} with hidden_act={act!r} is not supported (silu)")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope = _rope_parameters(cfg)
        eos = cfg.get("eos_token_id")
        v4 = arch == "DeepseekV4ForCausalLM"
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return ArchConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size") or cfg["moe_intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", flags["qkv_bias"])),
            qk_norm=flags["qk_norm"],
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=None if v4 else _sliding_window(cfg),
            deepseek=DeepseekParams.from_hf(arch, cfg) if arch in DEEPSEEK_ARCHITECTURES else None,
            v4=_v4_params(cfg) if v4 else None,
            indexer=_indexer_params(cfg) if arch == "DeepseekV32ForCausalLM" else None,
        )

    def inv_freq(self) -> torch.Tensor:
        """Rotary inverse frequencies [head_dim/2], as HF computes them (fp32)."""
        dim = self.head_dim
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
        inv_freq = 1.0 / (self.rope_theta**exponent)
        if self.rope_scaling is None:
            return inv_freq
        kind = self.rope_scaling.get("rope_type") or self.rope_scaling.get("type")
        if kind == "llama3":
            return _llama3_inv_freq(inv_freq, self.rope_scaling)
        if kind == "linear":
            return inv_freq / float(self.rope_scaling["factor"])
        raise UnsupportedModelError(
            f"rope scaling {kind!r} is not supported (default, linear, llama3)"
        )


def _v4_params(cfg: dict) -> DeepseekV4Params:
    try:
        return DeepseekV4Params.from_hf(cfg)
    except DeepseekV4ConfigError as e:
        raise UnsupportedModelError(f"DeepseekV4ForCausalLM config.json: {e}") from None


def _indexer_params(cfg: dict) -> IndexerParams:
    try:
        return IndexerParams.from_hf(cfg)
    except IndexerConfigError as e:
        raise UnsupportedModelError(f"DeepseekV32ForCausalLM config.json: {e}") from None


def _v41_refusal(cfg: dict) -> str:
    """What DeepSeek V4.1 adds that laneserve does not run, named from its config."""
    missing = ["reading the language model's config nested under `text_config`"]
    if cfg.get("vision_config") is not None:
        missing.append("its vision tower (`vision_config`): laneserve has no image encoder")
    return (
        "DeepseekV41ForCausalLM (DeepSeek V4.1) is not supported; laneserve runs the "
        "text-only DeepseekV4ForCausalLM. Missing: " + "; ".join(missing)
    )


def _rope_parameters(cfg: dict) -> dict:
    # transformers >= 5 writes "rope_parameters"; older configs have
    # "rope_theta" and "rope_scaling" at the top level.
    params = dict(cfg.get("rope_parameters") or {})
    if "rope_theta" not in params and "rope_theta" in cfg:
        params["rope_theta"] = cfg["rope_theta"]
    scaling = cfg.get("rope_scaling")
    if scaling:
        params.update(scaling)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params["type"]
    return params


def _sliding_window(cfg: dict) -> int | None:
    window = cfg.get("sliding_window")
    if window is None:
        return None
    if cfg.get("use_sliding_window") is False:
        return None
    return int(window)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)
