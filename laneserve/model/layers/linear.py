"""Linear layers: y = x @ W^T (+ b) through the kernels, and where a weight comes from.

Activations are float32 on CPU whatever the weight dtype (the CPU kernels
stream bf16/fp16 weights and accumulate in fp32); on CUDA they are the weight
dtype. Every op goes through a `Kernels` object so the same model code runs on
the C++ CPU kernels or on plain torch.
"""

from __future__ import annotations

from typing import Any

import torch

from laneserve.kernels import Kernels, PackedWeight
from laneserve.kernels.quant import QuantWeight
from laneserve.kernels.scaled import ScaledWeight

# A linear weight as a layer takes it: dense, GGUF blocks, or block-scaled fp8 / fp4
LinearWeight = torch.Tensor | QuantWeight | ScaledWeight


def linear_weight(get: Any, name: str, default: torch.Tensor | None = None) -> LinearWeight:
    """A linear weight from a weight getter: kept quantized where the getter offers that
    (`WeightStore.quantized_linear`: GGUF blocks, or a checkpoint's fp8 / fp4 blocks with
    `quantized_weights="resident"`), else `default` if given, else `get(name)`."""
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
        weight: LinearWeight,  # a GGUF / fp8 / fp4 quantized one stays quantized
        bias: torch.Tensor | None,
        quantize: str | None = None,  # weight-only quantization at load (kernels.QUANTIZATIONS)
    ) -> None:
        self.kernels = kernels
        self.weight: PackedWeight
        if isinstance(weight, QuantWeight):
            self.weight = kernels.pack_gguf_weight(weight)
        elif isinstance(weight, ScaledWeight):
            self.weight = kernels.pack_scaled_weight(weight)
        else:
            self.weight = kernels.pack_linear_weight(weight, quantize)
        self.bias = bias
        self.out_features = int(weight.shape[0])

    def __call__(self, x: torch.Tensor, first_prefill: int | None = None) -> torch.Tensor:
        """Rows [first_prefill, M) are prompt rows (Kernels.linear); None: none are."""
        if first_prefill is None:
            return self.kernels.linear(x, self.weight, self.bias)
        return self.kernels.linear(x, self.weight, self.bias, first_prefill)
