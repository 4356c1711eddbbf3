"""A tiny DeepSeek V4 checkpoint written directly in the layout DeepSeek releases.

Every name, shape and storage kind below is taken from the public loaders of the
released checkpoints, not from transformers' renaming: DeepSeek's V4 inference
`model.py` (module attributes: `attn.kv_norm`, `attn.attn_sink`, `attn.compressor`,
`attn.indexer`, `ffn.gate.{weight,bias|tid2eid}`, `hc_{attn,ffn}_{fn,base,scale}`,
`hc_head_*`, `mtp.N.{e_proj,h_proj,enorm,hnorm,norm}`), vLLM's `deepseek_v4.py` weight
mapper (top-level `embed.` / `norm.` / `head.weight` / `hc_head*` / `mtp.` prefixes,
`.scale` companions) and a public inventory of the V4-Flash index (which matrices
carry an FP8 `.scale`: the attention projections, `indexer.wq_b`, shared experts and
`mtp.0.{e,h}_proj`; compressors and `indexer.weights_proj` stay unquantized; routed
experts are MXFP4). The config has the release's keys: `compress_ratios` with the MTP
layer's trailing entry, `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling` with
`type: yarn`, `expert_dtype` and `quantization_config.scale_fmt`.

`build_release_v4` writes two directories: the release (quantized, sharded, with an
index) and a reference holding the same names with the exact dequantized values in
fp32 and no quantization config, which transformers loads through its own mapping of
the released names.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

HIDDEN, VOCAB, HEADS, HEAD_DIM, ROPE_DIM = 64, 320, 4, 32, 8
Q_LORA, O_GROUPS, O_LORA, INTER, EXPERTS, TOP_K = 32, 2, 16, 64, 8, 2
INDEX_HEADS, INDEX_DIM, HC = 8, 16, 2
RATIOS = [0, 4, 128, 4]  # sliding, CSA, HCA, CSA


def release_config(**overrides: object) -> dict:
    cfg: dict = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "moe_intermediate_size": INTER,
        "num_hidden_layers": len(RATIOS),
        "num_attention_heads": HEADS,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "qk_rope_head_dim": ROPE_DIM,
        "q_lora_rank": Q_LORA,
        "o_groups": O_GROUPS,
        "o_lora_rank": O_LORA,
        "n_routed_experts": EXPERTS,
        "n_shared_experts": 1,
        "num_experts_per_tok": TOP_K,
        "num_hash_layers": 1,
        "compress_ratios": [*RATIOS, 0],  # the trailing entry is the MTP layer's
        "compress_rope_theta": 40000,
        "rope_theta": 10000,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 4,
            "original_max_position_embeddings": 256,
            "type": "yarn",
        },
        "max_position_embeddings": 1024,
        "sliding_window": 8,
        "index_n_heads": INDEX_HEADS,
        "index_head_dim": INDEX_DIM,
        "index_topk": 3,
        "hc_mult": HC,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "swiglu_limit": 0.6,
        "num_nextn_predict_layers": 1,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
        "expert_dtype": "fp4",
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128],
        },
    }
    cfg.update(overrides)
    return cfg


# kind: "fp8" (e4m3 + ue8m0 `.scale` per 128 x 128), "fp4" (e2m1 pairs in I8 + ue8m0
# `.scale` per 32 values), "bf16", "fp32", "ids" (int32 expert table)
Spec = dict[str, tuple[tuple[int, ...], str]]


def _compressor(stem: str, ratio: int, width: int) -> Spec:
    coff = 2 if ratio == 4 else 1  # ratio 4 overlaps windows: two halves per entry
    return {
        f"{stem}.ape": ((ratio, coff * width), "fp32"),
        f"{stem}.wkv.weight": ((coff * width, HIDDEN), "bf16"),
        f"{stem}.wgate.weight": ((coff * width, HIDDEN), "bf16"),
        f"{stem}.norm.weight": ((width,), "bf16"),
    }


def block_spec(prefix: str, ratio: int, hashed: bool) -> Spec:
    """One released block (`layers.N` or `mtp.N`)."""
    a, f = f"{prefix}.attn", f"{prefix}.ffn"
    spec: Spec = {
        f"{a}.attn_sink": ((HEADS,), "fp32"),
        f"{a}.wq_a.weight": ((Q_LORA, HIDDEN), "fp8"),
        f"{a}.q_norm.weight": ((Q_LORA,), "bf16"),
        f"{a}.wq_b.weight": ((HEADS * HEAD_DIM, Q_LORA), "fp8"),
        f"{a}.wkv.weight": ((HEAD_DIM, HIDDEN), "fp8"),
        f"{a}.kv_norm.weight": ((HEAD_DIM,), "bf16"),
        f"{a}.wo_a.weight": ((O_GROUPS * O_LORA, HEADS * HEAD_DIM // O_GROUPS), "fp8"),
        f"{a}.wo_b.weight": ((HIDDEN, O_GROUPS * O_LORA), "fp8"),
        f"{prefix}.attn_norm.weight": ((HIDDEN,), "bf16"),
        f"{prefix}.ffn_norm.weight": ((HIDDEN,), "bf16"),
        f"{f}.gate.weight": ((EXPERTS, HIDDEN), "bf16"),
    }
    if ratio:
        spec.update(_compressor(f"{a}.compressor", ratio, HEAD_DIM))
    if ratio == 4:
        spec[f"{a}.indexer.wq_b.weight"] = ((INDEX_HEADS * INDEX_DIM, Q_LORA), "fp8")
        spec[f"{a}.indexer.weights_proj.weight"] = ((INDEX_HEADS, HIDDEN), "bf16")
        spec.update(_compressor(f"{a}.indexer.compressor", ratio, INDEX_DIM))
    if hashed:
        spec[f"{f}.gate.tid2eid"] = ((VOCAB, TOP_K), "ids")
    else:
        spec[f"{f}.gate.bias"] = ((EXPERTS,), "fp32")
    for e in range(EXPERTS):
        for w, shape in (("w1", (INTER, HIDDEN)), ("w2", (HIDDEN, INTER)), ("w3", (INTER, HIDDEN))):
            spec[f"{f}.experts.{e}.{w}.weight"] = (shape, "fp4")
    for w, shape in (("w1", (INTER, HIDDEN)), ("w2", (HIDDEN, INTER)), ("w3", (INTER, HIDDEN))):
        spec[f"{f}.shared_experts.{w}.weight"] = (shape, "fp8")
    mix = (2 + HC) * HC
    for part in ("attn", "ffn"):
        spec[f"{prefix}.hc_{part}_fn"] = ((mix, HC * HIDDEN), "fp32")
        spec[f"{prefix}.hc_{part}_base"] = ((mix,), "fp32")
        spec[f"{prefix}.hc_{part}_scale"] = ((3,), "fp32")
    return spec


def _head(prefix: str) -> Spec:
    return {
        f"{prefix}hc_head_fn": ((HC, HC * HIDDEN), "fp32"),
        f"{prefix}hc_head_base": ((HC,), "fp32"),
        f"{prefix}hc_head_scale": ((1,), "fp32"),
        f"{prefix}norm.weight": ((HIDDEN,), "bf16"),
    }


def release_spec(cfg: dict) -> Spec:
    """Every tensor of a released checkpoint with this config (`.scale` companions
    are implied by the kinds "fp8" / "fp4")."""
    n, hashed = cfg["num_hidden_layers"], cfg["num_hash_layers"]
    spec: Spec = {
        "embed.weight": ((VOCAB, HIDDEN), "bf16"),
        "head.weight": ((VOCAB, HIDDEN), "bf16"),
        **_head(""),
    }
    for i in range(n):
        spec.update(block_spec(f"layers.{i}", cfg["compress_ratios"][i], i < hashed))
    for m in range(int(cfg.get("num_nextn_predict_layers") or 0)):
        p = f"mtp.{m}"
        spec.update(block_spec(p, cfg["compress_ratios"][n + m], False))
        spec.update(_head(f"{p}."))
        for name in ("enorm", "hnorm"):
            spec[f"{p}.{name}.weight"] = ((HIDDEN,), "bf16")
        for name in ("e_proj", "h_proj"):
            spec[f"{p}.{name}.weight"] = ((HIDDEN, HIDDEN), "fp8")
    return spec


def _value(name: str, shape: tuple[int, ...], kind: str, gen: torch.Generator) -> torch.Tensor:
    """Random values that keep every part decisive (no neutral defaults)."""
    if kind == "ids":
        return torch.stack(
            [torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(shape[0])]
        )
    if name.endswith(("norm.weight", "_scale")):
        return torch.empty(shape).uniform_(0.7, 1.3, generator=gen)
    if name.endswith(("attn_sink",)):
        return torch.randn(shape, generator=gen)
    if name.endswith(("ape", "_base")):
        return torch.randn(shape, generator=gen) * 0.5
    if name.endswith("gate.bias"):
        return torch.randn(shape, generator=gen) * 0.1
    if name.endswith(("e_proj.weight", "h_proj.weight")):
        return torch.randn(shape, generator=gen) * HIDDEN**-0.5
    w = torch.randn(shape, generator=gen) * 0.15
    if name.endswith(("_fn", "gate.weight")) or name == "head.weight":
        w = w * 4.0  # decisive mixing, routing and logits
    return w


def _store(name: str, w: torch.Tensor, kind: str) -> tuple[dict, torch.Tensor]:
    """(released tensors, the exact fp32 values they hold)."""
    from laneserve.model.layers import fp8

    if kind in ("fp8", "fp4"):
        q, s = fp8.quantize_ue8m0(w, kind == "fp4")
        stem = name.removesuffix(".weight")
        return {name: q, f"{stem}.scale": s}, fp8.dequantize_scaled(q, s)
    if kind == "bf16":
        b = w.to(torch.bfloat16)
        return {name: b}, b.float()
    if kind == "ids":
        return {name: w.to(torch.int32)}, w.to(torch.int32)
    return {name: w.float().contiguous()}, w.float().contiguous()


def build_release_v4(
    out: Path, reference: Path, *, seed: int = 0, shards: int = 3, **overrides: object
) -> tuple[Path, Path]:
    from safetensors.torch import save_file

    from tests.tiny_models import build_tokenizer

    cfg = release_config(**overrides)
    gen = torch.Generator().manual_seed(seed)
    released: dict[str, torch.Tensor] = {}
    exact: dict[str, torch.Tensor] = {}
    for name, (shape, kind) in release_spec(cfg).items():
        stored, value = _store(name, _value(name, shape, kind, gen), kind)
        released.update(stored)
        exact[name] = value
    _write_sharded(out, released, shards)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    build_tokenizer(out, VOCAB)
    reference.mkdir(parents=True, exist_ok=True)
    save_file(exact, str(reference / "model.safetensors"))
    ref_cfg = {k: v for k, v in cfg.items() if k not in ("quantization_config", "expert_dtype")}
    ref_cfg["torch_dtype"] = "float32"
    (reference / "config.json").write_text(json.dumps(ref_cfg, indent=2))
    build_tokenizer(reference, VOCAB)
    return out, reference


def _write_sharded(out: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    """`model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`; a
    weight and its `.scale` may land in different shards, as in a release."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    weight_map: dict[str, str] = {}
    total = 0
    for i in range(shards):
        part = names[i * len(names) // shards : (i + 1) * len(names) // shards]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(out / file))
        for n in part:
            weight_map[n] = file
            total += tensors[n].numel() * tensors[n].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
