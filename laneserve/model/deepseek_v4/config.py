"""The DeepSeek V4 parameters of an HF `config.json` (`DeepseekV4ForCausalLM`).

Kept apart from `model/arch.py` so the V2 / V3 dataclass stays as it is; `ArchConfig.v4`
holds one of these for a V4 checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
_LEGACY_RATIOS = {0: SLIDING, 4: CSA, 128: HCA}


@dataclass(frozen=True)
class DeepseekV4Params:
    """Attention kinds, compressors, hyper-connections and hash-routed MoE of V4."""

    layer_types: tuple[str, ...]  # per layer: SLIDING, CSA or HCA
    mlp_layer_types: tuple[str, ...]  # per layer: "hash_moe" or "moe"
    compress_rates: dict[str, int]  # CSA -> m, HCA -> m'
    q_lora_rank: int
    head_dim: int  # the single K = V head and every query head
    rope_dim: int  # trailing dims that are rotated (head_dim * partial_rotary_factor)
    main_rope: dict  # rope parameters of sliding layers
    compress_rope: dict  # rope parameters of CSA / HCA layers and their compressors
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    swiglu_limit: float
    scoring_func: str
    num_nextn_predict_layers: int

    def rate(self, layer_type: str) -> int:
        return self.compress_rates[layer_type]

    @staticmethod
    def from_hf(cfg: dict) -> DeepseekV4Params:
        n = int(cfg["num_hidden_layers"])
        head_dim = int(cfg.get("head_dim") or 512)
        layer_types = cfg.get("layer_types")
        if layer_types is None and cfg.get("compress_ratios") is not None:
            layer_types = [_LEGACY_RATIOS[int(r)] for r in cfg["compress_ratios"]]
        if layer_types is None:
            mix = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
            layer_types = [HCA] * min(n, 2) + mix
        rates = {CSA: 4, HCA: 128, **(cfg.get("compress_rates") or {})}
        mlp_types = cfg.get("mlp_layer_types")
        if mlp_types is None:
            hashed = int(cfg.get("num_hash_layers", 3))
            mlp_types = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
        factor = cfg.get("partial_rotary_factor")
        if factor is None:
            factor = int(cfg.get("qk_rope_head_dim", 64)) / head_dim
        main, compress = _rope_sets(cfg, float(factor))
        return DeepseekV4Params(
            layer_types=tuple(layer_types[:n]),
            mlp_layer_types=tuple(mlp_types[:n]),
            compress_rates={CSA: int(rates[CSA]), HCA: int(rates[HCA])},
            q_lora_rank=int(cfg["q_lora_rank"]),
            head_dim=head_dim,
            rope_dim=int(head_dim * float(factor)),
            main_rope=main,
            compress_rope=compress,
            sliding_window=int(cfg.get("sliding_window") or 128),
            o_groups=int(cfg["o_groups"]),
            o_lora_rank=int(cfg["o_lora_rank"]),
            index_n_heads=int(cfg["index_n_heads"]),
            index_head_dim=int(cfg["index_head_dim"]),
            index_topk=int(cfg["index_topk"]),
            hc_mult=int(cfg.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(cfg.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(cfg.get("hc_eps", 1e-6)),
            n_routed_experts=int(cfg["n_routed_experts"]),
            num_experts_per_tok=int(cfg["num_experts_per_tok"]),
            n_shared_experts=int(cfg.get("n_shared_experts") or 0),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            swiglu_limit=float(cfg.get("swiglu_limit", 10.0)),
            scoring_func=str(cfg.get("scoring_func", "sqrtsoftplus")),
            num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0),
        )


def _rope_sets(cfg: dict, factor: float) -> tuple[dict, dict]:
    """(main, compress) rope parameters, as transformers' V4 config derives them."""
    rp = dict(cfg.get("rope_parameters") or {})
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return dict(rp["main"]), dict(rp["compress"])
    yarn = {k: v for k, v in rp.items() if k not in ("main", "compress")}
    yarn.update(cfg.get("rope_scaling") or {})
    main = {"rope_type": "default", "rope_theta": float(cfg.get("rope_theta", 10000.0))}
    compress = {**yarn, "rope_theta": float(cfg.get("compress_rope_theta", 160000.0))}
    compress.setdefault("rope_type", "default")
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    main["partial_rotary_factor"] = compress["partial_rotary_factor"] = factor
    return main, compress
