"""The MTP head as a trainable torch module: the same math as `model/llama/mtp.py`
(which runs it on the paged cache with the inference kernels), written with
autograd ops over whole padded sequences with causal attention."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from laneserve.model.arch import ArchConfig
from laneserve.model.llama.mtp import mtp_prefix
from laneserve.model.loader import Checkpoint
from laneserve.model.registry import open_weights

_LAYER = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)  # fmt: skip


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class MtpTrainModule(nn.Module):
    # buffers, registered in __init__ (declared for the type checker)
    embed: torch.Tensor  # [V, H] frozen
    final_norm: torch.Tensor
    head_full: torch.Tensor  # [V, H]
    inv_freq: torch.Tensor
    draft_vocab: torch.Tensor  # [Vd] token ids the head drafts from
    head_draft: torch.Tensor  # [Vd, H] rows of head_full
    vocab_index: torch.Tensor  # [V] position in draft_vocab, -1 outside it

    def __init__(
        self, arch: ArchConfig, base: dict[str, torch.Tensor], layer: dict[str, torch.Tensor]
    ) -> None:
        super().__init__()
        self.arch = arch
        h = arch.hidden_size
        self.register_buffer("embed", base["embed"], persistent=False)  # [V, H] frozen
        self.register_buffer("final_norm", base["norm"], persistent=False)
        self.register_buffer("head_full", base["head"], persistent=False)  # [V, H]
        self.register_buffer("inv_freq", arch.inv_freq(), persistent=False)
        self.enorm = nn.Parameter(torch.ones(h))
        self.hnorm = nn.Parameter(torch.ones(h))
        self.eh_proj = nn.Parameter(torch.randn(h, 2 * h) * (0.5 / h**0.5))
        with torch.no_grad():  # start as "mostly the embedding path"
            self.eh_proj[:, :h] += torch.eye(h) * 0.5
            self.eh_proj[:, h:] += torch.eye(h) * 0.5
        self.layer = nn.ParameterDict(
            {k.replace(".", "__"): nn.Parameter(v.clone()) for k, v in layer.items()}
        )
        self.register_buffer("draft_vocab", torch.arange(arch.vocab_size), persistent=False)
        self.register_buffer("head_draft", base["head"], persistent=False)  # [Vd, H] rows
        self.register_buffer("vocab_index", torch.arange(arch.vocab_size), persistent=False)

    @staticmethod
    def from_base(ckpt: Checkpoint, model: object) -> MtpTrainModule:
        del model
        store = open_weights(ckpt, torch.device("cpu"), torch.float32)
        arch = ckpt.arch

        def get(name: str) -> torch.Tensor:
            return store(name).float()

        embed = get("model.embed_tokens.weight")
        head = embed if arch.tie_word_embeddings else get("lm_head.weight")
        last = f"model.layers.{arch.num_layers - 1}"
        names = [f"{n}.weight" for n in _LAYER] + [
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
        ]
        if arch.qkv_bias:
            names += [f"self_attn.{p}_proj.bias" for p in "qkv"]
        if arch.qk_norm:
            names += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        layer = {n: get(f"{last}.{n}") for n in names}
        base = {"embed": embed, "norm": get("model.norm.weight"), "head": head}
        return MtpTrainModule(arch, base, layer)

    def set_draft_vocab(self, vocab: torch.Tensor) -> None:
        self.draft_vocab = vocab.to(torch.int64)
        index = torch.full((self.arch.vocab_size,), -1, dtype=torch.int64)
        index[self.draft_vocab] = torch.arange(len(vocab))
        self.vocab_index = index
        self.head_draft = self.head_full.index_select(0, self.draft_vocab)

    def w(self, name: str) -> torch.Tensor:
        return self.layer[name.replace(".", "__")]

    def forward(
        self, next_tokens: torch.Tensor, hidden: torch.Tensor, only: torch.Tensor | None = None
    ) -> torch.Tensor:
        """next_tokens [B, L] = t[i+1], hidden [B, L, H] = target h[i] -> logits [B, L, Vd],
        or [n, Vd] at the n positions where `only` [B, L] is true (the MLP and the head, which
        act per position, then run only there; attention still sees every position)."""
        a = self.arch
        e = _rms(F.embedding(next_tokens, self.embed), self.enorm, a.rms_norm_eps)
        x = torch.cat([e, _rms(hidden, self.hnorm, a.rms_norm_eps)], dim=-1) @ self.eh_proj.T
        y = x + self._attention(_rms(x, self.w("input_layernorm.weight"), a.rms_norm_eps))
        if only is not None:
            y = y[only]
        z = _rms(y, self.w("post_attention_layernorm.weight"), a.rms_norm_eps)
        gate = F.linear(z, self.w("mlp.gate_proj.weight"))
        up = F.linear(z, self.w("mlp.up_proj.weight"))
        y = y + F.linear(F.silu(gate) * up, self.w("mlp.down_proj.weight"))
        normed = _rms(y, self.final_norm, a.rms_norm_eps)
        return normed @ self.head_draft.T

    @torch.no_grad()
    def teacher_logits(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The target's own logits over the draft vocabulary from its normed hidden [.., H]."""
        return target_hidden @ self.head_draft.T

    def _proj(self, x: torch.Tensor, name: str) -> torch.Tensor:
        bias = self.layer[f"self_attn__{name}_proj__bias"] if self.arch.qkv_bias else None
        return F.linear(x, self.w(f"self_attn.{name}_proj.weight"), bias)

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        a = self.arch
        b, n, _ = x.shape
        q = self._proj(x, "q").view(b, n, a.num_heads, a.head_dim)
        k = self._proj(x, "k").view(b, n, a.num_kv_heads, a.head_dim)
        v = self._proj(x, "v").view(b, n, a.num_kv_heads, a.head_dim)
        if a.qk_norm:
            q = _rms(q, self.w("self_attn.q_norm.weight"), a.rms_norm_eps)
            k = _rms(k, self.w("self_attn.k_norm.weight"), a.rms_norm_eps)
        freqs = torch.arange(n, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        group = a.num_heads // a.num_kv_heads
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return F.linear(out.transpose(1, 2).reshape(b, n, -1), self.w("self_attn.o_proj.weight"))

    def export(self, path: Path, metadata: dict[str, str]) -> None:
        from safetensors.torch import save_file

        p = mtp_prefix(self.arch)
        tensors = {
            f"{p}.enorm.weight": self.enorm,
            f"{p}.hnorm.weight": self.hnorm,
            f"{p}.eh_proj.weight": self.eh_proj,
            **{f"{p}.{k.replace('__', '.')}": v for k, v in self.layer.items()},
        }
        out = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in tensors.items()}
        out["draft_vocab"] = self.draft_vocab.to(torch.int64).contiguous()
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(out, str(path), metadata=metadata)
        _normal_file_mode(path)


def _normal_file_mode(path: Path) -> None:
    """The mode a plainly created file gets (safetensors writes through a private
    temporary file, mode 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[None, :, None, :] + rotated * sin[None, :, None, :]
