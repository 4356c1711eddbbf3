"""Block-quantized FP8 checkpoints (the DeepSeek V3 release format).

A quantized matrix W [R, C] is stored as `float8_e4m3fn` values q with a scale
per (bR x bC) block, `<name>_scale_inv` [ceil(R / bR), ceil(C / bC)] (the
last row / column of blocks may be partial): W = q * scale_inv[block]. The
loader dequantizes at load time to the run dtype.
"""

from __future__ import annotations

import torch


class UnsupportedQuantizationError(ValueError):
    """The checkpoint's quantization method is not one laneserve can load."""


def block_size_of(cfg: dict) -> tuple[int, int] | None:
    """The FP8 block size from config.json's `quantization_config` (None: unquantized)."""
    q = cfg.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method != "fp8":
        raise UnsupportedQuantizationError(
            f"quantization method {method!r} is not supported; laneserve loads unquantized "
            "checkpoints and block-quantized fp8 (quant_method 'fp8', weight_block_size)"
        )
    if q.get("fmt", "e4m3") != "e4m3":
        raise UnsupportedQuantizationError(f"fp8 format {q['fmt']!r} is not supported (e4m3)")
    block = q.get("weight_block_size") or [128, 128]
    return int(block[0]), int(block[1])


def dequantize(
    q: torch.Tensor,  # [R, C] float8_e4m3fn
    scale_inv: torch.Tensor,  # [ceil(R / bR), ceil(C / bC)]
    block: tuple[int, int],
) -> torch.Tensor:  # [R, C] fp32
    rows, cols = q.shape
    br, bc = block
    want = (-(-rows // br), -(-cols // bc))
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"scale shape {tuple(scale_inv.shape)}, expected {want} for {(rows, cols)}"
        )
    scale = scale_inv.float().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return q.float() * scale


def quantize(
    w: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values, scale_inv) of a matrix; the inverse of `dequantize` up to fp8 rounding
    (used to build test checkpoints)."""
    rows, cols = w.shape
    br, bc = block
    scales = torch.empty((-(-rows // br), -(-cols // bc)), dtype=torch.float32)
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn)
    fmax = torch.finfo(torch.float8_e4m3fn).max
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = w[i * br : (i + 1) * br, j * bc : (j + 1) * bc].float()
            s = tile.abs().max().clamp_min(1e-12) / fmax
            scales[i, j] = s
            q[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = (tile / s).to(torch.float8_e4m3fn)
    return q, scales
