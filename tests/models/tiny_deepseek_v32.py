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
`write_release_layout` rewrites it as DeepSeek ships V3.2: FP8 projections with
`weight_scale_inv` (ue8m0 powers of two per 128 x 128 block), the rest bf16, two
shards with an index, and the MTP layer `model.layers.{num_hidden_layers}`;
`add_mtp_layer` adds that layer (random) to the unquantized checkpoint.
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


# the release's `quantization_config` (FP8 e4m3, power-of-two scales per 128 x 128 block)
RELEASE_FP8 = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}
# released tensors kept unquantized (bf16; the gate's correction bias fp32)
_PLAIN = ("norm", "layernorm", "embed_tokens", "lm_head", "gate.weight", "weights_proj", "head")


def write_release_layout(src: Path, out: Path, *, seed: int = 1) -> Path:
    """`src` as DeepSeek ships V3.2: projections FP8 with `weight_scale_inv`, the rest bf16
    (`e_score_correction_bias` fp32), the MTP layer `model.layers.{L}` (random, with its
    indexer), two shards and `model.safetensors.index.json`."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((src / "config.json").read_text())
    state = load_file(str(src / "model.safetensors"))
    state |= _mtp_layer(state, cfg, seed)
    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            (out / f.name).write_bytes(f.read_bytes())
    cfg |= {"num_nextn_predict_layers": 1, "quantization_config": RELEASE_FP8}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        if name.endswith("e_score_correction_bias"):
            tensors[name] = w.float()
        elif w.dim() == 2 and not any(p in name for p in _PLAIN):
            tensors[name], tensors[f"{name}_scale_inv"] = _fp8_blocks(w.float())
        else:
            tensors[name] = w.to(torch.bfloat16)
    names = sorted(tensors)
    index = {}
    for k, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        file = f"model-{k + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(out / file))
        index |= dict.fromkeys(part, file)
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    return out


def _fp8_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, fp32 power-of-two scale per block) encoding `w` approximately."""
    rows, cols = w.shape
    grid = (-(-rows // block), -(-cols // block))
    scale = torch.empty(grid)
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            r, c = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            amax = float(w[r, c].abs().max().clamp(min=1e-12))
            scale[i, j] = 2.0 ** torch.ceil(torch.log2(torch.tensor(amax / 448.0)))
            q[r, c] = (w[r, c] / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def add_mtp_layer(model_dir: Path, *, seed: int = 0) -> Path:
    """Append a random MTP layer (the release's names, `model.layers.{L}`, its indexer
    included) to a tiny V3.2 checkpoint of one `model.safetensors`, and declare it in
    config.json (`num_nextn_predict_layers: 1`)."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    state = load_file(str(model_dir / "model.safetensors"))
    save_file({**state, **_mtp_layer(state, cfg, seed)}, str(model_dir / "model.safetensors"))
    (model_dir / "config.json").write_text(json.dumps(cfg | {"num_nextn_predict_layers": 1}))
    return model_dir


def _mtp_layer(state: dict[str, torch.Tensor], cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """A random MTP layer `model.layers.{L}`: a MoE decoder layer shaped like the last one
    (indexer included) plus `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, and the
    target's `embed_tokens` and LM head as its `embed_tokens` / `shared_head.head`."""
    g = torch.Generator().manual_seed(seed)
    last, mtp = cfg["num_hidden_layers"] - 1, cfg["num_hidden_layers"]
    h, p = cfg["hidden_size"], f"model.layers.{mtp}."
    shapes = {
        k.replace(f"model.layers.{last}.", p): v.shape
        for k, v in state.items()
        if k.startswith(f"model.layers.{last}.")
    }
    shapes |= {p + n: (h,) for n in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")}
    shapes[p + "eh_proj.weight"] = (h, 2 * h)
    layer = {name: _random(name, shape, g) for name, shape in shapes.items()}
    layer[p + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    layer[p + "shared_head.head.weight"] = state["lm_head.weight"].clone()
    return layer


def _random(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Values of the scale the tiny target's tensors of that kind have."""
    if "norm" in name and name.endswith("weight"):
        return torch.rand(shape, generator=g) * 0.6 + 0.7
    if name.endswith(("bias", "e_score_correction_bias")):
        return torch.randn(shape, generator=g) * 0.1
    return torch.randn(shape, generator=g) * (0.6 if name.endswith("gate.weight") else 0.15)


def build_copying_mtp(src: Path, out: Path) -> Path:
    """A one-layer V3.2 target (`src`'s last decoder layer, a MoE one) with an MTP layer
    that copies it: embedding rows of RMS 1, `enorm` the identity on them, `eh_proj`
    passing the token's embedding only, `shared_head.norm` the target's final norm.

    The MTP layer at position i then computes the target's layer on token i + 1 over
    the tokens 1 .. i + 1 (at positions 0 .. i), where the target at i + 1 sees
    0 .. i + 1: its draft is the target's next token most of the time, not always
    (the attention, its indexer's top k included, sees one token less)."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((src / "config.json").read_text())
    state = load_file(str(src / "model.safetensors"))
    last, h, eps = f"model.layers.{cfg['num_hidden_layers'] - 1}.", HIDDEN, cfg["rms_norm_eps"]
    layer = {k.removeprefix(last): v for k, v in state.items() if k.startswith(last)}
    emb = state["model.embed_tokens.weight"]
    emb = emb / emb.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-12)
    top = ("model.norm.weight", "lm_head.weight")
    tensors = {n: state[n] for n in top} | {"model.embed_tokens.weight": emb}
    tensors |= {f"model.layers.0.{k}": v for k, v in layer.items()}
    tensors |= {f"model.layers.1.{k}": v.clone() for k, v in layer.items()}
    tensors |= {
        "model.layers.1.enorm.weight": torch.full((h,), (1.0 + eps) ** 0.5),
        "model.layers.1.hnorm.weight": torch.ones(h),
        "model.layers.1.eh_proj.weight": torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1),
        "model.layers.1.shared_head.norm.weight": state["model.norm.weight"].clone(),
        "model.layers.1.shared_head.head.weight": state["lm_head.weight"].clone(),
        "model.layers.1.embed_tokens.weight": emb.clone(),
    }
    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            (out / f.name).write_bytes(f.read_bytes())
    layout = {"num_hidden_layers": 1, "first_k_dense_replace": 0, "num_nextn_predict_layers": 1}
    (out / "config.json").write_text(json.dumps(cfg | layout, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out
