"""Linear weights as the kernels take them: :class:`PackedWeight` and the int8 quantizer.

Shared by both implementations; each ``pack_linear_weight`` validates with
:func:`check_weight` and, for ``quantize="int8"``, calls :func:`quantize_int8` through
this module (``weights.quantize_int8``), so one patch point sees every quantization.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Weight-only quantizations `pack_linear_weight` can apply at load (None: keep the dtype).
QUANTIZATIONS = ("int8",)


@dataclass(frozen=True)
class PackedWeight:
    """A linear weight prepared once for ``linear`` by the kernels object that packed it."""

    data: torch.Tensor
    out_features: int
    in_features: int
    dtype: torch.dtype  # the weight's dtype as packed: the original's, or torch.int8
    layout: str
    scale: torch.Tensor | None = None  # [N] fp32 column scales of int8 weights; [N, K/32]
    # group scales of TorchKernels' GGUF weights with int8 activations (q8.py)
    offset: torch.Tensor | None = None  # [N, K/32] fp32 group offsets of the latter (q4_1, q4_k)
    group: int | None = None  # block-scaled fp8 / fp4 (scaled.py): columns per scale; the
    # scales are then in `scale` (the layout names the format)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric weight-only int8 per output row: ``w ~= q * scale[:, None]``,
    q in [-127, 127]; returns (q [N, K] int8, scale [N] fp32)."""
    w32 = w.detach().float()
    amax = w32.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w32 / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def check_weight(w: torch.Tensor, quantize: str | None) -> None:
    """Raise for a weight ``pack_linear_weight`` cannot take (shape, dtype, quantization)."""
    if w.dim() != 2:
        raise ValueError(f"linear weight must be 2-D [N, K], got shape {tuple(w.shape)}")
    if w.dtype not in WEIGHT_DTYPES:
        raise TypeError(f"unsupported linear weight dtype {w.dtype}")
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise ValueError(f"unknown weight quantization {quantize!r}; supported: {QUANTIZATIONS}")
