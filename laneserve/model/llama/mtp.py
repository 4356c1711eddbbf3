"""DeepSeek-V3-style multi-token-prediction head for a Llama-family model.

For position i (target hidden h[i], the normed last-layer output, and the
next token t[i+1]):

    x  = eh_proj(concat(enorm(embed(t[i+1])), hnorm(h[i])))      # 2H -> H, embedding first
    h' = decoder_layer(x)            # the base architecture, its own paged KV cache
    logits(t[i+2]) = lm_head(norm(h'))   # shared final norm (or shared_head.norm) and head

Weights use DeepSeek-V3 names under `model.layers.{num_hidden_layers}.`
(`enorm`, `hnorm`, `eh_proj`, the decoder layer's usual names, optionally
`shared_head.norm`), from the checkpoint itself or a separate safetensors
file. An optional `draft_vocab` tensor restricts the draft head to the
frequent tokens it was trained on (a smaller LM-head matmul per draft).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from laneserve.kernels import Kernels
from laneserve.model.arch import ArchConfig
from laneserve.model.interface import PAGED
from laneserve.model.layers.attention import AttentionMetadata
from laneserve.model.layers.linear import Linear
from laneserve.model.layers.norm import RMSNorm
from laneserve.model.layers.weights import WeightGetter
from laneserve.model.llama.model import DecoderLayer, LlamaModel
from laneserve.model.loader import WeightStore


def mtp_prefix(arch: ArchConfig) -> str:
    return f"model.layers.{arch.num_layers}"


class MtpHead:
    step_kind = PAGED  # its group's AttentionMetadata
    cache_groups = ("mtp",)

    def __init__(
        self,
        arch: ArchConfig,
        kernels: Kernels,
        get: WeightGetter,
        has: Callable[[str], bool],  # whether the checkpoint holds a tensor
        base: LlamaModel,
        base_get: WeightGetter,  # the base checkpoint's tensors (for lm_head rows)
        draft_vocab: torch.Tensor | None,  # [Vd] int64 token ids, or None = full vocabulary
        quantize: str | None = None,  # weight-only quantization of the head's own linears
    ) -> None:
        p = mtp_prefix(arch)
        self.base = base
        self.kernels = kernels
        self.enorm = RMSNorm(kernels, get(f"{p}.enorm.weight"), arch.rms_norm_eps)
        self.hnorm = RMSNorm(kernels, get(f"{p}.hnorm.weight"), arch.rms_norm_eps)
        self.eh_proj = Linear(kernels, get(f"{p}.eh_proj.weight"), None, quantize)
        self.layer = DecoderLayer(arch, kernels, get, p, base.layers[0].rotary, quantize)
        own_norm = f"{p}.shared_head.norm.weight"
        self.norm = (
            RMSNorm(kernels, get(own_norm), arch.rms_norm_eps) if has(own_norm) else base.norm
        )
        self.draft_vocab = draft_vocab
        if draft_vocab is None:  # NOTE: the shared LM head stays as the target uses it
            self.head = base.lm_head
        else:
            rows = base.embed_tokens if arch.tie_word_embeddings else base_get("lm_head.weight")
            rows = rows.index_select(0, draft_vocab.to(rows.device))
            self.head = Linear(kernels, rows, None, quantize)

    def forward(
        self,
        next_tokens: torch.Tensor,  # [T] t[i+1] for each position i
        hidden: torch.Tensor,  # [T, H] target (or previous MTP) normed hidden at i
        positions: torch.Tensor,  # [T] i
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, ...],  # its group's (K, V)
    ) -> torch.Tensor:  # [T, H] normed MTP output (feeds the head and the next depth)
        k_cache, v_cache = kv_cache
        e = self.enorm(self.base.embed(next_tokens))
        h = self.hnorm(hidden)
        x = self.eh_proj(torch.cat([e, h], dim=-1))
        residual = x
        y = self.layer.input_norm(x)
        y = self.layer(positions, y, residual, (k_cache, v_cache), meta)
        self.norm.add_(y, residual)  # y = norm(residual + mlp_out)
        return y

    def draft(self, normed: torch.Tensor, n: int = 1) -> torch.Tensor:  # [N, n] best first
        return self.kernels.top_tokens(self.head(normed), n, self.draft_vocab)


SHIPPED_HEADS = {
    # default-model name -> packaged file (laneserve/assets)
    "SmolLM2-135M-Instruct": "mtp-smollm2-135m-instruct.safetensors",
}


class MtpWeightsError(ValueError):
    """No usable MTP weights for this model."""


def shipped_head_path(model_name: str) -> Path | None:
    name = SHIPPED_HEADS.get(model_name)
    if name is None:
        return None
    path = Path(__file__).resolve().parents[2] / "assets" / name
    return path if path.is_file() else None


def mtp_weight_source(
    store: WeightStore, draft_weights: str | None, default_name: str | None
) -> WeightStore:
    """Where the head's tensors come from: the given file, the checkpoint, or the shipped head."""
    ckpt = store.ckpt
    if draft_weights:
        return store.sibling(Path(draft_weights).expanduser())
    if store.has(f"{mtp_prefix(ckpt.arch)}.eh_proj.weight"):
        return store
    shipped = shipped_head_path(default_name) if default_name else None
    if shipped is not None:
        return store.sibling(shipped)
    raise MtpWeightsError(
        f"{ckpt.source} carries no MTP layer ({mtp_prefix(ckpt.arch)}.eh_proj.weight): pass "
        '"draft_weights": PATH in --speculative-config, or train one with `laneserve train-mtp`'
    )


def load_mtp_head(
    store: WeightStore,
    base: LlamaModel,
    kernels: Kernels,
    draft_weights: str | None,
    default_name: str | None,
    quantize: str | None = None,
) -> MtpHead:
    src = mtp_weight_source(store, draft_weights, default_name)
    arch = store.ckpt.arch
    meta = src.metadata()
    if meta.get("hidden_size") and int(meta["hidden_size"]) != arch.hidden_size:
        raise MtpWeightsError(
            f"MTP weights are for hidden size {meta['hidden_size']}, the model has {arch.hidden_size}"
        )
    vocab = src.raw("draft_vocab").to(torch.int64) if src.has("draft_vocab") else None
    if vocab is not None and (vocab.min() < 0 or vocab.max() >= arch.vocab_size):
        raise MtpWeightsError("draft_vocab holds ids outside the model's vocabulary")
    return MtpHead(arch, kernels, src, src.has, base, store, vocab, quantize)
