"""A tiny random DeepSeek V4 checkpoint (transformers' `save_pretrained` layout) and
helpers that check it exercises what the tests claim to test.

Every part that transformers initialises to a neutral value is randomised so a wrong
implementation cannot pass by accident: norms around 1, attention sinks, compressor
position biases, hyper-connection bases and scales, router score bias, and `tid2eid`
(the default all-zeros table would send every token to expert 0).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

V4_LAYER_TYPES = [
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "compressed_sparse_attention",
]


def deepseek_v4_config(**overrides: object):  # -> DeepseekV4Config
    from transformers import DeepseekV4Config

    cfg = dict(
        vocab_size=320,
        hidden_size=64,
        moe_intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        q_lora_rank=32,
        partial_rotary_factor=0.25,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        layer_types=V4_LAYER_TYPES,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        hc_mult=2,
        hc_sinkhorn_iters=20,
        sliding_window=8,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=8,
        index_head_dim=16,
        index_topk=3,
        rope_theta=10000.0,
        compress_rope_theta=40000.0,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        max_position_embeddings=512,
        routed_scaling_factor=1.5,
        swiglu_limit=0.6,
        num_nextn_predict_layers=0,
        initializer_range=0.15,
        bos_token_id=0,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    cfg.update(overrides)
    return DeepseekV4Config(**cfg)


def _randomise(model: torch.nn.Module, gen: torch.Generator, top_k: int) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(torch.empty_like(p).uniform_(0.7, 1.3, generator=gen))
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith(("position_bias", "attn_hc.base", "ffn_hc.base", "hc_base")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif name.endswith(("attn_hc.scale", "ffn_hc.scale", "hc_head.hc_scale")):
                p.copy_(torch.empty_like(p).uniform_(0.5, 1.5, generator=gen))
            elif name.endswith(("attn_hc.fn", "ffn_hc.fn", "hc_fn", "gate.weight")):
                p.mul_(4.0)  # decisive mixing and routing
            elif name == "lm_head.weight":
                p.mul_(4.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
            elif name.endswith("tid2eid"):
                experts = model.config.n_routed_experts
                rows = [torch.randperm(experts, generator=gen)[:top_k] for _ in range(b.shape[0])]
                b.copy_(torch.stack(rows))


def build_tiny_deepseek_v4(out: Path, *, seed: int = 0, **overrides: object) -> Path:
    """save_pretrained output of a randomised tiny V4 (fp32) plus a small tokenizer."""
    from transformers import DeepseekV4ForCausalLM

    from tests.tiny_models import build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, 320)
    cfg = deepseek_v4_config(**overrides)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed + 1000)
    _randomise(model, gen, cfg.num_experts_per_tok)
    model.generation_config.eos_token_id = None
    model.save_pretrained(str(out))
    return out


def indexer_score_gaps(model: torch.nn.Module, ids: list[int]) -> list[float]:
    """For every CSA layer and every query with more causally valid compressed entries
    than `index_topk`: the gap between its k-th and (k+1)-th best indexer score, from
    transformers' own scorer over the whole sequence in one forward."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    captured: list[torch.Tensor] = []
    hooks = [
        mod.register_forward_hook(lambda _m, _i, out: captured.append(out.detach()))
        for mod in model.modules()
        if isinstance(mod, m.DeepseekV4IndexerScorer)
    ]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    k, rate = model.config.index_topk, model.config.compress_rates["compressed_sparse_attention"]
    gaps = []
    for scores in captured:  # [1, S, T]
        for t in range(scores.shape[1]):
            valid = (t + 1) // rate
            if valid > k:
                top = scores[0, t, :valid].sort(descending=True).values
                gaps.append(float(top[k - 1] - top[k]))
    return gaps


def to_release_layout(src: Path, out: Path) -> Path:
    """The same weights under the release names: no `model.` prefix, `embed.weight`,
    `hc_head_fn` / `hc_head_base` / `hc_head_scale` (config and tokenizer copied)."""
    import shutil

    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, out / f.name)
    state = load_file(str(src / "model.safetensors"))
    renamed = {_release_name(name): t.contiguous() for name, t in state.items()}
    save_file(renamed, str(out / "model.safetensors"))
    return out


_FP8 = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "shared_experts.w1", "shared_experts.w2")
_FP8 += ("shared_experts.w3",)


def quantized_release(src: Path, out: Path, reference: Path) -> tuple[Path, Path]:
    """`out`: the release layout with FP8 (ue8m0 block scales) attention and shared-expert
    matrices and FP4-packed routed experts; `reference`: a save_pretrained-layout copy
    holding exactly the dequantized values (what transformers should be compared with)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from laneserve.model.layers import fp8

    to_release_layout(src, out)
    state = load_file(str(out / "model.safetensors"))
    quantized, exact = {}, {}
    for name, t in state.items():
        stem = name.removesuffix(".weight")
        fp4 = ".ffn.experts." in name
        if name.endswith(".weight") and (fp4 or stem.endswith(_FP8)):
            q, s = fp8.quantize_ue8m0(t, fp4)
            quantized[name], quantized[f"{stem}.scale"] = q, s
            exact[name] = fp8.dequantize_scaled(q, s)
        else:
            quantized[name] = exact[name] = t
    save_file(quantized, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0"}
    (out / "config.json").write_text(json.dumps(cfg))
    reference.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, reference / f.name)
    original = load_file(str(src / "model.safetensors"))
    release_of = {_release_name(n): n for n in original}
    save_file({release_of[n]: t for n, t in exact.items()}, str(reference / "model.safetensors"))
    return out, reference


def _release_name(name: str) -> str:
    """save_pretrained name -> released name (checked against the released list in
    `release_deepseek_v4.py` by test_deepseek_v4_release)."""
    name = name.removeprefix("model.").replace("embed_tokens.weight", "embed.weight")
    name = name.replace(".attn.norm.weight", ".attn.kv_norm.weight")
    return name.replace("hc_head.hc_", "hc_head_")


def add_v4_mtp_layer(release: Path, *, seed: int = 0) -> Path:
    """Adds a random `mtp.0.*` layer to a release-layout checkpoint (in place): attention
    and hyper-connection shapes from the sliding layer 0, a scored (not hashed) MoE from
    layer 1, each perturbed so that no tensor equals the target's; its own e_proj /
    h_proj, norms and hc_head."""
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(seed)
    state = load_file(str(release / "model.safetensors"))
    h = state["embed.weight"].shape[1]

    def noisy(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t.clone()
        spread = t.float().std().clamp(min=0.05) if t.numel() > 1 else 0.1
        return (t + torch.randn(t.shape, generator=gen) * spread).to(t.dtype)

    mtp = {}
    for name, t in state.items():
        if name.startswith("layers.0.") and ".ffn." not in name:
            mtp["mtp.0." + name.removeprefix("layers.0.")] = noisy(t)
        elif name.startswith("layers.1.ffn."):
            mtp["mtp.0." + name.removeprefix("layers.1.")] = noisy(t)
    for proj in ("e_proj", "h_proj"):
        mtp[f"mtp.0.{proj}.weight"] = torch.randn(h, h, generator=gen) * h**-0.5
    for norm in ("enorm", "hnorm", "norm"):
        mtp[f"mtp.0.{norm}.weight"] = torch.empty(h).uniform_(0.7, 1.3, generator=gen)
    for part in ("fn", "base", "scale"):
        mtp[f"mtp.0.hc_head_{part}"] = noisy(state[f"hc_head_{part}"])
    save_file({**state, **mtp}, str(release / "model.safetensors"))
    return release


def hf_mtp_reference(release: Path, out: Path) -> Path:
    """A one-layer save_pretrained checkpoint whose layer 0 is the `mtp.0` block, its
    hc_head and final norm the block's, embedding and LM head the target's: run on
    the block's input streams it computes the MTP layer's logits with transformers'
    own attention, MoE and hyper-connections."""
    import shutil

    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in release.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(num_hidden_layers=1, layer_types=[V4_LAYER_TYPES[0]], mlp_layer_types=["moe"])
    (out / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(release / "model.safetensors"))
    ref = {
        "model.embed_tokens.weight": state["embed.weight"],
        "head.weight": state["head.weight"],
        "model.norm.weight": state["mtp.0.norm.weight"],
    }
    for part in ("fn", "base", "scale"):
        ref[f"model.hc_head.hc_{part}"] = state[f"mtp.0.hc_head_{part}"]
    skip = ("e_proj", "h_proj", "enorm", "hnorm", "norm.weight", "hc_head_")
    for name, t in state.items():
        if name.startswith("mtp.0.") and not name.removeprefix("mtp.0.").startswith(skip):
            ref["model.layers.0." + name.removeprefix("mtp.0.")] = t
    save_file(ref, str(out / "model.safetensors"))
    return out


def build_exact_deepseek_v4_mtp(
    out: Path, *, seed: int = 0, inert_layers: int = 0, **overrides: object
) -> Path:
    """A release-layout V4 whose next token depends only on the current one, with an
    `mtp.0` layer that copies its deciding layer, so every draft is the target's next
    token (DeepSeek V4's MTP speed-up measured without acceptance noise).

    Layer 0 (sliding, scored MoE) decides: its attention output is zeroed and the
    embedding rows have RMS 1. The `inert_layers` after it have their attention and
    expert output projections zeroed: full cost, no effect. Every hyper-connection has
    a zero `fn`, so its weights are constants, and equal post weights keep the streams
    equal (a mixing matrix whose columns sum to 1 then leaves them as they are). The MTP
    layer takes the next token's embedding alone (`e_proj` the identity, `h_proj` zero)
    and copies layer 0, the final norm and `hc_head`."""
    from safetensors.torch import load_file, save_file

    total = 1 + inert_layers
    types = list(overrides.pop("layer_types", None) or V4_LAYER_TYPES * total)[:total]
    mlp = list(overrides.pop("mlp_layer_types", None) or ["moe"] * total)[:total]
    assert types[0] == "sliding_attention", "the MTP layer's attention is sliding-window"
    overrides.update(num_hidden_layers=total, layer_types=types, mlp_layer_types=["moe", *mlp[1:]])
    src = build_tiny_deepseek_v4(out.with_name(out.name + "-src"), seed=seed, **overrides)
    w = load_file(str(src / "model.safetensors"))
    n = int(json.loads((src / "config.json").read_text())["hc_mult"])
    emb = w["model.embed_tokens.weight"]
    w["model.embed_tokens.weight"] = emb / emb.pow(2).mean(-1, keepdim=True).sqrt()
    for name, t in w.items():
        if name.endswith(("hc_attn_fn", "hc_ffn_fn", "hc_head.hc_fn")):
            t.zero_()
        if name.endswith(("hc_attn_base", "hc_ffn_base")):
            t[n : 2 * n] = 0.0  # post weights 2 sigmoid(0) = 1 on every stream
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if layer is not None and name.endswith("attn.wo_b.weight"):
            t.zero_()
        if layer not in (None, "0") and name.endswith("w2.weight"):
            t.zero_()  # routed and shared experts of the inert layers
    save_file(w, str(src / "model.safetensors"))
    to_release_layout(src, out)
    state = load_file(str(out / "model.safetensors"))
    h = state["embed.weight"].shape[1]
    mtp = {"mtp.0." + k.removeprefix("layers.0."): t.clone() for k, t in state.items()
           if k.startswith("layers.0.")}  # fmt: skip
    mtp["mtp.0.e_proj.weight"] = torch.eye(h)
    mtp["mtp.0.h_proj.weight"] = torch.zeros(h, h)
    mtp["mtp.0.enorm.weight"] = torch.ones(h)
    mtp["mtp.0.hnorm.weight"] = torch.ones(h)
    mtp["mtp.0.norm.weight"] = state["norm.weight"].clone()
    for part in ("fn", "base", "scale"):
        mtp[f"mtp.0.hc_head_{part}"] = state[f"hc_head_{part}"].clone()
    save_file({**state, **mtp}, str(out / "model.safetensors"))
    return out
