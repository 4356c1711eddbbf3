"""A tiny random DeepSeek V3.2 checkpoint with the released checkpoint's names and
config keys.

Names: the release is HF-named like V3 (`model.layers.N.self_attn.*`, one tensor per
expert) plus each attention layer's indexer under `self_attn.indexer.`: `wq_b`, `wk`
(fp8 with `weight_scale_inv` in the release), `k_norm` (a LayerNorm: weight and bias)
and `weights_proj` (unquantized), as vLLM's and SGLang's V3.2 loaders read them
(`{prefix}.indexer.{wq_b,wk,k_norm,weights_proj}`). Config: V3's released keys
(`rope_scaling` with `type: yarn` and a top-level `rope_theta`, `topk_method`,
`scoring_func`, `n_group`, `first_k_dense_replace`, `num_nextn_predict_layers`) plus
`index_topk`, `index_head_dim`, `index_n_heads` (the keys and names of DeepSeek's
V3.2 inference config). transformers makes the random weights; `RELEASE_LAYER_NAMES`
checks its state dict against the released names before it is written.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.tiny_models import build_tokenizer

HIDDEN, VOCAB, HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V = 64, 320, 4, 32, 32, 16, 8, 16
EXPERTS, INDEX_HEADS, INDEX_DIM = 8, 16, 16


def release_config(**overrides: object) -> dict:
    cfg: dict = {
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "ep_size": 1,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "index_head_dim": INDEX_DIM,
        "index_n_heads": INDEX_HEADS,
        "index_topk": 6,
        "initializer_range": 0.15,
        "intermediate_size": 128,
        "kv_lora_rank": KV_LORA,
        "max_position_embeddings": 512,
        "moe_intermediate_size": 32,
        "moe_layer_freq": 1,
        "n_group": 4,
        "n_routed_experts": EXPERTS,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": HEADS,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 3,
        "num_key_value_heads": HEADS,
        "num_nextn_predict_layers": 0,
        "q_lora_rank": Q_LORA,
        "qk_nope_head_dim": NOPE,
        "qk_rope_head_dim": ROPE,
        "rms_norm_eps": 1e-6,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 4,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 128,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": 2,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "v_head_dim": V,
        "vocab_size": VOCAB,
    }
    cfg.update(overrides)
    return cfg


def release_layer_names(i: int, dense: bool) -> set[str]:
    """Every tensor of released layer `i` (unquantized: no `weight_scale_inv`)."""
    a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
    attn = [
        "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
        "kv_b_proj", "o_proj", "indexer.wq_b", "indexer.wk", "indexer.k_norm",
        "indexer.weights_proj",
    ]  # fmt: skip
    names = {f"{a}.{n}.weight" for n in attn} | {f"{a}.indexer.k_norm.bias"}
    names |= {
        f"model.layers.{i}.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm")
    }
    mlps = ["gate_proj", "up_proj", "down_proj"]
    if dense:
        return names | {f"{m}.{w}.weight" for w in mlps}
    names |= {f"{m}.gate.weight", f"{m}.gate.e_score_correction_bias"}
    names |= {f"{m}.shared_experts.{w}.weight" for w in mlps}
    return names | {f"{m}.experts.{e}.{w}.weight" for e in range(EXPERTS) for w in mlps}


def release_names(cfg: dict) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(cfg["num_hidden_layers"]):
        names |= release_layer_names(i, i < cfg["first_k_dense_replace"])
    return names


def build_tiny_deepseek_v32(out: Path, *, seed: int = 0, **overrides: object) -> Path:
    """The checkpoint (config.json as released, model.safetensors, a tokenizer)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, DeepseekV32ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, VOCAB)
    cfg = release_config(**overrides)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    hf_cfg = AutoConfig.from_pretrained(str(out))  # the released keys, read by transformers
    torch.manual_seed(seed)
    model = DeepseekV32ForCausalLM(hf_cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.7, 1.3) if name.endswith("weight") else p.normal_(0, 0.1)
            elif "lm_head" in name:
                p.mul_(4.0)
            elif name.endswith("gate.weight"):
                p.mul_(4.0)  # decisive routing
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    tmp = out / "hf"
    model.save_pretrained(str(tmp))  # transformers' own mapping back to the per-expert names
    from safetensors import safe_open

    with safe_open(str(tmp / "model.safetensors"), "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()
    if set(state) != release_names(cfg):
        raise AssertionError(f"not the released names: {sorted(set(state) ^ release_names(cfg))}")
    save_file(state, str(out / "model.safetensors"))
    return out
