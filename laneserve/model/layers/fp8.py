"""Block-quantized FP8 checkpoints (the DeepSeek V3 release format).

A quantized matrix W [R, C] is stored as `float8_e4m3fn` values q with a scale
per (bR x bC) block, `<name>_scale_inv` [ceil(R / bR), ceil(C / bC)] (the
last row / column of blocks may be partial): W = q * scale_inv[block]. The
loader keeps the linear weights resident as stored (`resident`, kernels/scaled.py)
with `quantized_weights="resident"`, or dequantizes them at load time to the run
dtype (`dequantize`, `dequantize_scaled`).
"""

from __future__ import annotations

import torch

from laneserve.kernels import scaled
from laneserve.kernels.scaled import ScaledWeight


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


def covering_blocks(start: int, length: int, size: int, block: int) -> tuple[slice, slice, int]:
    """The values and the scales of the whole blocks (along one dimension of `size`)
    that cover [start, start + length), and where the range starts in those values."""
    lo, hi = start // block * block, min(-(-(start + length) // block) * block, size)
    return slice(lo, hi), slice(lo // block, -(-hi // block)), start - lo


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


def resident(
    q: torch.Tensor,  # float8_e4m3fn [R, C], or int8 fp4 pairs [R, ceil(C / 2)]
    scale: torch.Tensor,  # its `_scale_inv` / `.scale` companion
    block: tuple[int, int],  # fp8 block (config.json's weight_block_size)
    shape: tuple[int, ...] | None,  # [R, C] where known (fp4 rows hold two columns a byte)
) -> ScaledWeight:
    """A checkpoint's fp8 / fp4 linear weight kept in its stored bytes (kernels/scaled.py).
    Raises ValueError for wrong scale shapes or NaN values / scales."""
    if q.dtype == torch.float8_e4m3fn:
        w = scaled.from_fp8_blocks(q, scale, block)
    else:
        cols = shape[1] if shape is not None and len(shape) == 2 else 2 * int(q.shape[1])
        w = scaled.from_fp4_packed(q, scale, cols)
    if not scaled.check_finite(w):
        raise ValueError("contains NaN or Inf values or scales")
    return w


# FP4 (e2m1) code -> value; a nibble's high bit is the sign
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES = torch.tensor(list(_E2M1) + [-v for v in _E2M1], dtype=torch.float32)
FP4_GROUP = 32  # values per ue8m0 scale along a row


def dequantize_scaled(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # fp32
    """A weight stored with a `<name>.scale` companion (the DeepSeek V4 release format):

    - `float8_e4m3fn` [R, C] with a ue8m0 (power of two) scale per 128 x 128 block;
    - FP4 e2m1 packed two per byte in `int8` [R, C / 2] (the low nibble is the even
      column) with a ue8m0 scale per 32 values of a row, [R, C / 32].
    """
    s = scale.float()
    if q.dtype == torch.float8_e4m3fn:
        return dequantize(q, s, (128, 128))
    if q.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"a .scale companion on a {q.dtype} tensor")
    codes = q.view(torch.uint8)
    rows, half = codes.shape
    lo, hi = (codes & 0x0F).long(), (codes >> 4).long()
    values = FP4_VALUES[torch.stack([lo, hi], dim=-1).view(rows, 2 * half)]
    if tuple(s.shape) != (rows, -(-2 * half // FP4_GROUP)):
        raise ValueError(f"FP4 scale shape {tuple(s.shape)} for {(rows, 2 * half)} values")
    return values * s.repeat_interleave(FP4_GROUP, dim=1)[:, : 2 * half]


def quantize_ue8m0(w: torch.Tensor, fp4: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ue8m0 scales) in the V4 release format, the inverse of
    `dequantize_scaled` up to rounding (used to build test checkpoints)."""
    w = w.float()
    rows, cols = w.shape
    if not fp4:
        br = bc = 128
        tiles = -(-rows // br), -(-cols // bc)
        amax = torch.zeros(tiles)
        for i in range(tiles[0]):
            for j in range(tiles[1]):
                amax[i, j] = w[i * br : (i + 1) * br, j * bc : (j + 1) * bc].abs().max()
        scale = torch.exp2(torch.ceil(torch.log2(amax.clamp_min(1e-30) / 448.0)))
        full = scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
        return (w / full).to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)
    padded = -(-cols // FP4_GROUP) * FP4_GROUP
    groups = torch.nn.functional.pad(w, (0, padded - cols)).view(rows, -1, FP4_GROUP)
    scale = torch.exp2(torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-30) / 6.0)))
    scaled = (groups / scale[..., None]).view(rows, padded)[:, :cols]
    codes = (scaled[..., None] - FP4_VALUES).abs().argmin(dim=-1).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), scale.to(torch.float8_e8m0fnu)
