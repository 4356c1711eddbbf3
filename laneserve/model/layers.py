"""Building blocks shared by the model families: linear, RMSNorm, rotary, MLP.

Activations are float32 on CPU whatever the weight dtype (the CPU kernels
stream bf16/fp16 weights and accumulate in fp32); on CUDA they are the weight
dtype. Every op goes through a `Kernels` object so the same model code runs on
the C++ CPU kernels or on plain torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from laneserve.kernels import Kernels, PackedWeight
from laneserve.kernels.quant import QuantWeight, cat_rows

__all__ = ["cat_rows", "linear_weight"]


def linear_weight(
    get: Any, name: str, default: torch.Tensor | None = None
) -> torch.Tensor | QuantWeight:
    """A linear weight from a weight getter: kept quantized where the getter offers that
    (`WeightStore.quantized_linear`), else `default` if given, else `get(name)`."""
    quantized = getattr(get, "quantized_linear", None)
    q = quantized(name) if quantized is not None else None
    if q is not None:
        return q
    return default if default is not None else get(name)


class Linear:
    """y = x @ W^T (+ b) with W packed once for the kernels."""

    def __init__(
        self,
        kernels: Kernels,
        weight: torch.Tensor | QuantWeight,  # a GGUF-quantized one stays quantized
        bias: torch.Tensor | None,
        quantize: str | None = None,  # weight-only quantization at load (kernels.QUANTIZATIONS)
    ) -> None:
        self.kernels = kernels
        self.weight: PackedWeight = (
            kernels.pack_gguf_weight(weight)
            if isinstance(weight, QuantWeight)
            else kernels.pack_linear_weight(weight, quantize)
        )
        self.bias = bias
        self.out_features = int(weight.shape[0])

    def __call__(self, x: torch.Tensor, first_prefill: int | None = None) -> torch.Tensor:
        """Rows [first_prefill, M) are prompt rows (Kernels.linear); None: none are."""
        if first_prefill is None:
            return self.kernels.linear(x, self.weight, self.bias)
        return self.kernels.linear(x, self.weight, self.bias, first_prefill)


class RMSNorm:
    def __init__(self, kernels: Kernels, weight: torch.Tensor, eps: float) -> None:
        self.kernels = kernels
        self.weight = weight
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)

    def add_(self, x: torch.Tensor, residual: torch.Tensor) -> None:
        """residual += x; x = norm(residual), both in place."""
        self.kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Rotary:
    """NeoX-style rotary embedding with a [max_pos, head_dim] cos|sin cache."""

    def __init__(
        self,
        kernels: Kernels,
        inv_freq: torch.Tensor,  # [head_dim / 2] fp32
        max_positions: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.kernels = kernels
        self.head_dim = head_dim
        # NOTE: same arithmetic as HF (fp32 position * inv_freq), so fp32 runs
        # match transformers bit for bit in the rotary part.
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]
        self.cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device=device, dtype=dtype)

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        self.kernels.rotary_embedding(positions, q, k, self.head_dim, self.cos_sin)


class GatedMLP:
    def __init__(
        self,
        kernels: Kernels,
        gate_up: torch.Tensor | QuantWeight,
        down: torch.Tensor | QuantWeight,
        quantize: str | None = None,
    ) -> None:
        self.kernels = kernels
        self.gate_up = Linear(kernels, gate_up, None, quantize)
        self.down = Linear(kernels, down, None, quantize)

    def __call__(self, x: torch.Tensor, first_prefill: int | None = None) -> torch.Tensor:
        return self.down(self.kernels.silu_and_mul(self.gate_up(x, first_prefill)), first_prefill)


class DecoderStack:
    """What every decoder family here shares after its own layers are built: the
    embedding, the pre-norm residual stack (each layer's input norm fused with the
    residual add of the layer before) and the LM head. Subclasses set the attributes.

    forward(ids, positions, meta, caches) -> (normed hidden, pre-norm hidden)."""

    embed_tokens: torch.Tensor  # [V, H]
    act_dtype: torch.dtype
    layers: Sequence[
        Any
    ]  # each: .input_norm (RMSNorm), called (pos, hidden, residual, cache, meta)
    norm: RMSNorm
    lm_head: Linear

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_tokens).to(self.act_dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: Any,  # AttentionMetadata
        caches: Sequence[Any],  # one per layer
    ) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [T, H]
        residual = self.embed(input_ids)
        hidden = self.layers[0].input_norm(residual)
        for i, layer in enumerate(self.layers):
            if i:
                layer.input_norm.add_(hidden, residual)
            hidden = layer(positions, hidden, residual, caches[i], meta)
        self.norm.add_(hidden, residual)
        return hidden, residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, V] fp32
        return self.lm_head(hidden).float()
