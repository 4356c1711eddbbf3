"""Tiny random Llama / Qwen2 / Qwen3 checkpoints built with transformers, with a
small byte-level BPE tokenizer and a chat template, for fast real-model tests.

The weights use a large init range so greedy argmaxes have clear margins
(fp32 differences between kernels then never flip a token).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The old lighthouse stood at the end of a narrow spit of rock.",
    "A computer learns patterns from millions of examples, one at a time.",
    "Cooking, gardening and music reward patience and careful attention.",
    "Zürich, São Paulo and Kraków — naïve café déjà vu 東京 🙂",
] * 20


MISTRAL_WINDOW = 40


def build_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def build_tiny_model(
    out: Path, family: str, *, seed: int = 0, tie: bool = False, max_positions: int = 512
) -> Path:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, 320)
    common = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        initializer_range=0.15,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family == "llama":
        cfg = LlamaConfig(
            **common,
            head_dim=16,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 50000.0,
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        cls = LlamaForCausalLM
    elif family == "qwen2":
        cfg, cls = (
            Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
            Qwen2ForCausalLM,
        )
    elif family == "qwen3":
        cfg, cls = Qwen3Config(**common, head_dim=16), Qwen3ForCausalLM
    elif family == "qwen3-gguf":  # transformers reads a qwen3 GGUF with its default head_dim
        cfg, cls = Qwen3Config(**common, head_dim=128), Qwen3ForCausalLM
    elif family == "llama-linear":  # linear rope scaling (position interpolation)
        rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
        cfg, cls = LlamaConfig(**common, head_dim=16, rope_parameters=rope), LlamaForCausalLM
    elif family == "mistral":  # a sliding window far below max_position_embeddings
        cfg = MistralConfig(
            **common,
            head_dim=16,
            sliding_window=MISTRAL_WINDOW,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
        cls = MistralForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    with torch.no_grad():  # biases and norms are zero/one by default: randomise them
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            elif "norm" in name:
                p.uniform_(0.7, 1.3)
            elif "lm_head" in name or (tie and "embed_tokens" in name):
                p.mul_(4.0)  # wider logits: clear greedy margins
    model.save_pretrained(str(out))
    return out


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy `generate` (fp32, one prompt, EOS ignored); memoised."""
    return list(_hf_greedy(str(model_dir), tuple(prompt), max_new_tokens))


@functools.cache
def _hf_greedy(model_dir: str, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    from transformers import GenerationConfig

    model = _cached_model(model_dir)
    ids = torch.tensor([prompt])
    # NOTE: no EOS at all (not min_new_tokens, which would ban EOS and change
    # the argmax): laneserve's ignore_eos keeps EOS as an ordinary token.
    cfg = GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
    return tuple(out[0, len(prompt) :].tolist())


@functools.cache
def _cached_model(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def build_bigram_model(out: Path, family: str = "llama", seed: int = 0) -> Path:
    """A 1-layer model whose attention output is zero: the next token depends
    only on the current one. Embedding rows have RMS 1, so an MTP head can copy
    its layer exactly (see `build_exact_mtp_head`)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, 320)
    common = dict(
        vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.3,
        bos_token_id=0, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    cfg, cls = (
        (LlamaConfig, LlamaForCausalLM) if family == "llama" else (Qwen3Config, Qwen3ForCausalLM)
    )
    torch.manual_seed(seed)
    model = cls(cfg(**common)).float().eval()
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.copy_(emb / emb.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-12))
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(str(out))
    return out


def build_exact_mtp_head(
    model_dir: Path, out: Path, draft_vocab: list[int] | None = None, noise: float = 0.0
) -> Path:
    """MTP weights that reproduce a bigram model's next-next token (100% acceptance);
    with `noise`, a perturbed copy whose best guess is often wrong but whose next-best
    ones often hold the right token (for token-tree alternatives)."""
    from safetensors.torch import load_file, save_file

    w = load_file(str(model_dir / "model.safetensors"))
    h = w["model.embed_tokens.weight"].shape[1]
    eps = 1e-6
    proj = torch.eye(h) + noise * torch.randn(h, h, generator=torch.Generator().manual_seed(0))
    t = {
        "model.layers.1.enorm.weight": torch.full((h,), (1.0 + eps) ** 0.5),
        "model.layers.1.hnorm.weight": torch.ones(h),
        "model.layers.1.eh_proj.weight": torch.cat([proj, torch.zeros(h, h)], dim=1),
    }
    for name, value in w.items():
        if name.startswith("model.layers.0."):
            t[name.replace("model.layers.0.", "model.layers.1.")] = value
    if draft_vocab is not None:
        t["draft_vocab"] = torch.tensor(draft_vocab, dtype=torch.int64)
    save_file({k: v.contiguous() for k, v in t.items()}, str(out), metadata={"hidden_size": str(h)})
    return out


def deepseek_v3_config(**overrides: object) -> object:
    """The tiny DeepSeek-V3 layout: MLA with q LoRA, yarn + interleaved rope, 8 experts
    top-2 in 4 groups (noaux_tc), one shared expert, one dense layer, one MTP layer."""
    from transformers import DeepseekV3Config

    kw: dict[str, object] = dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
        n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
        rope_interleave=True, num_nextn_predict_layers=1, max_position_embeddings=512,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 128, "mscale": 1.0, "mscale_all_dim": 1.0,
            "beta_fast": 32, "beta_slow": 1,
        },
        rms_norm_eps=1e-6, initializer_range=0.15, bos_token_id=0, eos_token_id=2,
        pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    kw.update(overrides)
    return DeepseekV3Config(**kw)


def deepseek_v2_config(**overrides: object) -> object:
    """The tiny DeepSeek-V2 layout: plain q_proj, softmax group-limited routing, no MTP."""
    from transformers import DeepseekV2Config

    kw: dict[str, object] = dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
        n_group=4, topk_group=2, n_shared_experts=2, routed_scaling_factor=1.5,
        topk_method="group_limited_greedy", max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6, initializer_range=0.15, bos_token_id=0, eos_token_id=2,
        pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    kw.update(overrides)
    return DeepseekV2Config(**kw)


def build_tiny_deepseek(out: Path, version: int = 3, *, seed: int = 0, **overrides: object) -> Path:
    """A tiny random DeepSeek V3 (or V2) checkpoint in the release layout (one tensor
    per expert), with randomised norms, router bias and a wide LM head."""
    from transformers import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, 320)
    if version == 3:
        cfg, cls = deepseek_v3_config(**overrides), DeepseekV3ForCausalLM
    else:
        cfg, cls = deepseek_v2_config(**overrides), DeepseekV2ForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.7, 1.3)
            elif "lm_head" in name:
                p.mul_(4.0)
            elif name.endswith("gate.weight"):
                p.mul_(4.0)  # decisive routing
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    model.generation_config.eos_token_id = None
    model.save_pretrained(str(out))
    return out


def _release_names(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """transformers' MtpLayer state dict -> the checkpoint's release names under `prefix`
    (per-expert tensors, `shared_head.norm`)."""
    out = {}
    for name, t in state.items():
        if name.startswith("mtp_block.mlp.experts."):
            x = f"{prefix}.mlp.experts"
            for e in range(t.shape[0]):
                if name.endswith("gate_up_proj"):
                    gate, up = t[e].chunk(2, dim=0)
                    out[f"{x}.{e}.gate_proj.weight"] = gate
                    out[f"{x}.{e}.up_proj.weight"] = up
                else:
                    out[f"{x}.{e}.down_proj.weight"] = t[e]
        elif name.startswith("post_norm."):
            out[f"{prefix}.shared_head.norm.weight"] = t
        else:
            out[f"{prefix}.{name.removeprefix('mtp_block.')}"] = t
    return {k: v.contiguous().clone() for k, v in out.items()}


def hf_mtp_layer(model_dir: Path) -> object:
    """transformers' generic MTP layer for the checkpoint's MTP layer index, loaded from it."""
    import json

    from safetensors.torch import load_file
    from transformers import DeepseekV3Config
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer,
        DeepseekV3RMSNorm,
    )

    cfg = DeepseekV3Config(**json.loads((model_dir / "config.json").read_text()))
    n = cfg.num_hidden_layers
    layer = MtpLayer(cfg, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, n).float().eval()
    saved = load_file(str(model_dir / "model.safetensors"))
    x = f"model.layers.{n}.mlp.experts"
    state = {}
    for name, t in layer.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            parts = [
                [saved[f"{x}.{e}.{p}_proj.weight"] for p in ("gate", "up")] for e in range(len(t))
            ]
            state[name] = torch.stack([torch.cat(g_u) for g_u in parts])
        elif name.endswith("experts.down_proj"):
            state[name] = torch.stack([saved[f"{x}.{e}.down_proj.weight"] for e in range(len(t))])
        else:
            (release,) = _release_names({name: t}, f"model.layers.{n}")
            state[name] = saved[release]
    layer.load_state_dict(state)
    return layer


def add_mtp_layer(model_dir: Path, *, seed: int = 0, exact_of: int | None = None) -> Path:
    """Append an MTP layer (release names) to a tiny DeepSeek V3 checkpoint: random, or,
    with `exact_of`, one that reproduces decoder layer `exact_of` (see
    `build_exact_deepseek_mtp`)."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer,
        DeepseekV3RMSNorm,
    )

    cfg = DeepseekV3Config(**json.loads((model_dir / "config.json").read_text()))
    n = cfg.num_hidden_layers
    w = load_file(str(model_dir / "model.safetensors"))
    torch.manual_seed(seed)
    layer = MtpLayer(cfg, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, n).float()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "norm" in name:
                p.uniform_(0.7, 1.3)
            else:
                p.normal_(0, 0.6 if name.endswith("gate.weight") else 0.15)
        for name, b in layer.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    p = f"model.layers.{n}"
    extra = _release_names(layer.state_dict(), p)
    if exact_of is not None:
        h = cfg.hidden_size
        src = f"model.layers.{exact_of}."
        extra = {k.replace(src, f"{p}."): v.clone() for k, v in w.items() if k.startswith(src)}
        extra[f"{p}.enorm.weight"] = torch.full((h,), (1.0 + cfg.rms_norm_eps) ** 0.5)
        extra[f"{p}.hnorm.weight"] = torch.ones(h)
        extra[f"{p}.eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
        extra[f"{p}.shared_head.norm.weight"] = w["model.norm.weight"].clone()
    extra[f"{p}.shared_head.head.weight"] = w["lm_head.weight"].clone()
    extra[f"{p}.embed_tokens.weight"] = w["model.embed_tokens.weight"].clone()
    save_file({**w, **extra}, str(model_dir / "model.safetensors"))
    return model_dir


def build_exact_deepseek_mtp(
    out: Path,
    seed: int = 0,
    *,
    keep_attention: bool = False,
    inert_layers: int = 0,
    **overrides: object,
) -> Path:
    """A 1-layer V3 whose attention output is zero (the next token depends only on the
    current one; embedding rows of RMS 1), with an MTP layer that copies its layer: the
    draft equals the target's next prediction (100 % acceptance). With `keep_attention`
    the attention stays: the copy then drafts the target's token most of the time (its
    attention sees the sequence shifted by one position), and its runners-up often.
    `inert_layers` more decoder layers follow the first with their attention and MLP
    output projections zeroed: they leave the residual stream unchanged (the draft stays
    exact) but cost a full layer each, so the target-to-draft cost ratio is that of a
    deep model."""
    from safetensors.torch import load_file, save_file

    layers = 1 + inert_layers
    overrides = {**overrides, "num_hidden_layers": layers, "first_k_dense_replace": 0}
    build_tiny_deepseek(out, 3, seed=seed, **overrides)
    w = load_file(str(out / "model.safetensors"))
    emb = w["model.embed_tokens.weight"]
    w["model.embed_tokens.weight"] = emb / emb.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-12)
    if not keep_attention:
        w["model.layers.0.self_attn.o_proj.weight"].zero_()
    inert = tuple(f"model.layers.{i}." for i in range(1, layers))
    for name, t in w.items():
        if name.startswith(inert) and name.endswith(("o_proj.weight", "down_proj.weight")):
            t.zero_()
    save_file(w, str(out / "model.safetensors"))
    return add_mtp_layer(out, exact_of=0)


# HF layer-part names -> llama.cpp GGUF names
_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_TOP_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}


def write_tiny_gguf(
    model_dir: Path, out: Path, arch: str | None = None, quant: dict[str, str] | None = None
) -> Path:
    """An F32 GGUF of an HF checkpoint, written the way llama.cpp's converter writes
    one: llama.cpp tensor names, the rotary row interleave of q/k for llama / mistral,
    hyperparameters and a byte-level BPE ("gpt2") tokenizer as metadata. `arch`
    overrides general.architecture (llama.cpp writes most Mistral files as "llama").
    `quant`: HF-name suffix -> GGUF type ("Q4_0", "Q4_1", "Q8_0") of matching 2-D tensors."""
    import json

    import gguf
    import numpy as np
    from safetensors.torch import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    arch = arch or cfg["model_type"]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(f"tiny-{cfg['model_type']}")
    _gguf_hparams(writer, cfg)
    _gguf_tokenizer(writer, model_dir, cfg)
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        array = tensor.float().numpy()
        if arch in ("llama", "mistral") and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            array = _gguf_permute(array, heads)
        array = np.ascontiguousarray(array, dtype=np.float32)
        kind = next((k for s, k in (quant or {}).items() if name.endswith(s)), None)
        if kind is not None and array.ndim == 2:
            qtype = getattr(gguf.GGMLQuantizationType, kind)
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(_gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _gguf_hparams(writer, cfg: dict) -> None:
    rope = cfg.get("rope_parameters") or {}
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_file_type(0)  # all F32


def _gguf_tokenizer(writer, model_dir: Path, cfg: dict) -> None:
    import json

    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tok.get("added_tokens", [])}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # control / normal
    writer.add_token_merges(merges)
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_pad_token_id(cfg["pad_token_id"])


def _gguf_name(hf_name: str) -> str:
    stem, _, kind = hf_name.rpartition(".")
    if stem in _GGUF_TOP_NAMES:
        return f"{_GGUF_TOP_NAMES[stem]}.{kind}"
    _, _, layer, part = stem.split(".", 3)  # model.layers.<i>.<part>
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[part]}.{kind}"


def _gguf_permute(w, heads: int):
    """llama.cpp's rotary row interleave of q/k (the inverse of what loaders undo)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
