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
_ROPE_TYPES = ("default", "yarn")
_EXPERT_DTYPES = (None, "fp4", "fp8")  # routed experts as shipped (None: as the rest)
_SCALE_FMTS = (None, "ue8m0")  # None: plain fp32 block scales


class DeepseekV4ConfigError(ValueError):
    """A V4 config.json value laneserve would otherwise misread."""


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
            layer_types = _legacy_layer_types(cfg, n)
        if layer_types is None:
            mix = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
            layer_types = [HCA] * min(n, 2) + mix
        rates = {CSA: 4, HCA: 128, **(cfg.get("compress_rates") or {})}
        mlp_types = cfg.get("mlp_layer_types")
        if mlp_types is None:
            hashed = _non_negative(cfg.get("num_hash_layers", 3), "num_hash_layers")
            mlp_types = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
        _check_quantization(cfg)
        _check_kinds(layer_types, LAYER_TYPES, "layer_types", n)
        _check_kinds(mlp_types, ("hash_moe", "moe"), "mlp_layer_types", n)
        factor = cfg.get("partial_rotary_factor")
        if factor is None:
            rope_head_dim = _non_negative(cfg.get("qk_rope_head_dim", 64), "qk_rope_head_dim")
            if rope_head_dim > head_dim or rope_head_dim % 2:
                raise DeepseekV4ConfigError(
                    f"qk_rope_head_dim={rope_head_dim} must be even and at most head_dim={head_dim}"
                )
            factor = rope_head_dim / head_dim
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


def _legacy_layer_types(cfg: dict, n: int) -> list[str]:
    """`compress_ratios` of a release config: one entry per layer (0 / 4 / 128), then
    the MTP layers' entries (and, in some releases, trailing zeros). laneserve runs
    the MTP layer with sliding-window attention, so its entry must be 0."""
    ratios = cfg["compress_ratios"]
    if not isinstance(ratios, list) or len(ratios) < n:
        raise DeepseekV4ConfigError(
            f"compress_ratios must list one ratio per layer ({n}); got {ratios!r}"
        )
    unknown = sorted({r for r in ratios if r not in _LEGACY_RATIOS}, key=str)
    if unknown:
        raise DeepseekV4ConfigError(
            f"compress_ratios values {unknown} are not DeepSeek V4 ratios {sorted(_LEGACY_RATIOS)}"
        )
    mtp = int(cfg.get("num_nextn_predict_layers") or 0)
    compressed_mtp = [r for r in ratios[n : n + mtp] if r != 0]
    if compressed_mtp:
        raise DeepseekV4ConfigError(
            f"compress_ratios gives the MTP layer the ratio {compressed_mtp[0]}: laneserve "
            "runs DeepSeek V4's MTP layer with sliding-window attention only (ratio 0)"
        )
    return [_LEGACY_RATIOS[r] for r in ratios[:n]]


def _check_kinds(kinds: object, known: tuple[str, ...], key: str, n: int) -> None:
    if not isinstance(kinds, list | tuple) or len(kinds) < n:
        raise DeepseekV4ConfigError(f"{key} must list one kind per layer ({n}); got {kinds!r}")
    unknown = sorted({str(k) for k in kinds[:n]} - set(known))
    if unknown:
        raise DeepseekV4ConfigError(f"{key} {unknown} are not DeepSeek V4 kinds {list(known)}")


def _non_negative(value: object, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DeepseekV4ConfigError(f"{key} must be a non-negative integer; got {value!r}")
    return value


def _check_quantization(cfg: dict) -> None:
    """`expert_dtype` and `quantization_config` as the release ships them; the weights
    themselves say how they are stored (a `.scale` companion per quantized matrix)."""
    expert_dtype = cfg.get("expert_dtype")
    q = cfg.get("quantization_config")
    if isinstance(q, dict) and "expert_dtype" in q:
        if expert_dtype is not None and q["expert_dtype"] != expert_dtype:
            raise DeepseekV4ConfigError(
                f"expert_dtype {expert_dtype!r} and quantization_config.expert_dtype "
                f"{q['expert_dtype']!r} disagree"
            )
        expert_dtype = q["expert_dtype"]
    if expert_dtype not in _EXPERT_DTYPES:
        raise DeepseekV4ConfigError(
            f"expert_dtype {expert_dtype!r} is not one of {list(_EXPERT_DTYPES)}"
        )
    if q is None:
        return
    if not isinstance(q, dict):
        raise DeepseekV4ConfigError(f"quantization_config must be an object; got {q!r}")
    if q.get("quant_method") != "fp8" or q.get("fmt", "e4m3") != "e4m3":
        raise DeepseekV4ConfigError(
            f"quantization_config {q!r}: DeepSeek V4 ships quant_method 'fp8' (fmt 'e4m3')"
        )
    if q.get("scale_fmt") not in _SCALE_FMTS:
        raise DeepseekV4ConfigError(
            f"quantization_config.scale_fmt {q.get('scale_fmt')!r} is not one of "
            f"{list(_SCALE_FMTS)}"
        )
    block = q.get("weight_block_size", [128, 128])
    if list(block) != [128, 128]:
        raise DeepseekV4ConfigError(f"weight_block_size {block!r}: DeepSeek V4 uses [128, 128]")


def _rope_type(params: dict, where: str) -> str:
    """`rope_type`, or the legacy `type` key (`rope_scaling` of release configs)."""
    kind = params.get("rope_type", params.get("type", "default"))
    if "type" in params and params.get("rope_type", kind) != params["type"]:
        raise DeepseekV4ConfigError(
            f"{where} has rope_type {params['rope_type']!r} and type {params['type']!r}"
        )
    if kind not in _ROPE_TYPES:
        raise DeepseekV4ConfigError(
            f"{where} rope type {kind!r} is not supported for DeepSeek V4 {list(_ROPE_TYPES)}"
        )
    return str(kind)


def _rope_sets(cfg: dict, factor: float) -> tuple[dict, dict]:
    """(main, compress) rope parameters, as transformers' V4 config derives them."""
    rp = dict(cfg.get("rope_parameters") or {})
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, compress = dict(rp["main"]), dict(rp["compress"])
        main["rope_type"] = _rope_type(main, "rope_parameters.main")
        compress["rope_type"] = _rope_type(compress, "rope_parameters.compress")
        return main, compress
    yarn = {k: v for k, v in rp.items() if k not in ("main", "compress")}
    yarn.update(cfg.get("rope_scaling") or {})
    main = {"rope_type": "default", "rope_theta": float(cfg.get("rope_theta", 10000.0))}
    compress = {**yarn, "rope_theta": float(cfg.get("compress_rope_theta", 160000.0))}
    compress["rope_type"] = _rope_type(compress, "rope_scaling")
    compress.pop("type", None)
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    main["partial_rotary_factor"] = compress["partial_rotary_factor"] = factor
    return main, compress
