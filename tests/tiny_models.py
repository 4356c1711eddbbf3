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


def build_tiny_model(out: Path, family: str, *, seed: int = 0, tie: bool = False) -> Path:
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
        max_position_embeddings=512,
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


def write_tiny_gguf(model_dir: Path, out: Path, arch: str | None = None) -> Path:
    """An F32 GGUF of an HF checkpoint, written the way llama.cpp's converter writes
    one: llama.cpp tensor names, the rotary row interleave of q/k for llama / mistral,
    hyperparameters and a byte-level BPE ("gpt2") tokenizer as metadata. `arch`
    overrides general.architecture (llama.cpp writes most Mistral files as "llama")."""
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
        writer.add_tensor(_gguf_name(name), np.ascontiguousarray(array, dtype=np.float32))
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
