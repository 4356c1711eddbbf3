"""Block-scaled FP8 / MXFP4 linear weights kept as the checkpoint stores them:
:class:`ScaledWeight`, its exact dequantizer and the torch reference product.

DeepSeek's releases store their projections in two block-scaled formats:

======  ===============================  ==========================================
fmt     values (``data``, uint8)         scales (``scale``)
======  ===============================  ==========================================
fp8     e4m3 bytes, [N, K]               one per ``group`` columns of a row, fp32
                                         (V3: ``weight_scale_inv`` per 128 x 128
                                         block; V4: a ue8m0 ``.scale``, exact in fp32)
fp4     e2m1 codes two per byte,         one ue8m0 exponent byte per 32 columns of a
        [N, ceil(K / 2)], low nibble     row, [N, ceil(K / 32)] uint8 (value
        = the even column                ``2 ** (byte - 127)``)
======  ===============================  ==========================================

The block scales are kept per row ([N, ceil(K / group)]: a 128 x 128 block's scale
repeated on its 128 rows, 4 bytes per 128 fp8 values), so weights concatenate along N
(fused gate|up) like dense ones. A last partial block (N or K not a multiple of the
block) is simply shorter.

NOTE (exactness): a weight is ``value * scale`` in fp32, one rounding (exact for ue8m0
scales): :func:`dequantize_rows` computes exactly that, the values of
``layers/fp8.py``'s load-time dequantizers. The CPU kernel (scaled_linear.cpp) computes
the same products in registers and runs the fp32 ``linear`` kernel's FMA chain over
k = 0..K-1, so its result is bitwise ``linear(x, pack_linear_weight(dequantize(w)))``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = ("fp8", "fp4")
FP4_GROUP = 32  # columns per ue8m0 scale of an fp4 row
# FP4 (e2m1) code -> value; a nibble's high bit is the sign
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES = torch.tensor(list(_E2M1) + [-v for v in _E2M1], dtype=torch.float32)
REFERENCE_ROWS = 128  # output rows dequantized at a time by the torch reference product


@dataclass(frozen=True)
class ScaledWeight:
    """A [N, K] linear weight in a checkpoint's block-scaled storage (module table)."""

    data: torch.Tensor  # uint8: fp8 [N, K]; fp4 [N, ceil(K / 2)]
    scale: torch.Tensor  # [N, ceil(K / group)]: fp32 (fp8) or uint8 ue8m0 exponents (fp4)
    fmt: str
    in_features: int
    group: int  # columns per scale along a row (fp8: the block's width; fp4: 32)

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown block-scaled format {self.fmt!r}; supported: {FORMATS}")
        k, n = self.in_features, int(self.data.shape[0])
        row_bytes = k if self.fmt == "fp8" else -(-k // 2)
        if (
            self.data.dim() != 2
            or self.data.dtype != torch.uint8
            or self.data.shape[1] != row_bytes
        ):
            raise ValueError(
                f"{self.fmt} weight data must be [N, {row_bytes}] uint8 for K={k}, got "
                f"{tuple(self.data.shape)} {self.data.dtype}"
            )
        if self.group < 1 or (self.fmt == "fp4" and self.group != FP4_GROUP):
            raise ValueError(f"{self.fmt}: scale group {self.group} is not supported")
        sdt = torch.float32 if self.fmt == "fp8" else torch.uint8
        want = (n, -(-k // self.group))
        if tuple(self.scale.shape) != want or self.scale.dtype != sdt:
            raise ValueError(
                f"{self.fmt} scale must be {want} {sdt}, got {tuple(self.scale.shape)} "
                f"{self.scale.dtype}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.data.shape[0]), self.in_features)

    @property
    def nbytes(self) -> int:
        """Bytes held (values and scales)."""
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale))


def from_fp8_blocks(
    q: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)] fp32 / e8m0
    block: tuple[int, int],
) -> ScaledWeight:
    """An fp8 weight with one scale per (bn x bk) block (V3 ``weight_scale_inv``, V4 ue8m0
    ``.scale``): the scales repeated per row. Raises ValueError for a wrong scale grid."""
    n, k = q.shape
    bn, bk = block
    want = (-(-n // bn), -(-k // bk))
    if q.dtype != torch.float8_e4m3fn or tuple(scale.shape) != want:
        raise ValueError(
            f"fp8 weight {tuple(q.shape)} {q.dtype} with scale {tuple(scale.shape)}: expected "
            f"float8_e4m3fn and a {want} scale grid"
        )
    rows = scale.float().repeat_interleave(bn, 0)[:n].contiguous()
    return ScaledWeight(q.contiguous().view(torch.uint8), rows, "fp8", k, bk)


def from_fp4_packed(
    q: torch.Tensor,  # [N, ceil(K / 2)] int8 / uint8, two e2m1 codes per byte
    scale: torch.Tensor,  # [N, ceil(K / 32)] float8_e8m0fnu (or its uint8 bytes)
    in_features: int,
) -> ScaledWeight:
    """An MXFP4 weight (V4 routed experts) as stored; raises ValueError for wrong shapes."""
    if q.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"fp4 weight must be int8 / uint8 pairs, got {q.dtype}")
    if scale.dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)
    elif scale.dtype != torch.uint8:
        raise ValueError(f"fp4 scale must be ue8m0, got {scale.dtype}")
    return ScaledWeight(
        q.contiguous().view(torch.uint8), scale.contiguous(), "fp4", in_features, FP4_GROUP
    )


def _scales(w: ScaledWeight, rows: slice) -> torch.Tensor:
    s = w.scale[rows]
    if w.fmt == "fp4":
        s = s.view(torch.float8_e8m0fnu).float()
    return s.repeat_interleave(w.group, dim=1)[:, : w.in_features]


def dequantize_rows(w: ScaledWeight, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of the exact fp32 weight (module NOTE)."""
    rows = slice(start, stop)
    k = w.in_features
    if w.fmt == "fp8":
        values = w.data[rows].view(torch.float8_e4m3fn).float()
    else:
        codes = w.data[rows]
        pairs = torch.stack([codes & 0x0F, codes >> 4], dim=-1).flatten(1)[:, :k]
        values = FP4_VALUES.to(codes.device)[pairs.long()]
    return values * _scales(w, rows)


def dequantize(w: ScaledWeight) -> torch.Tensor:
    """The whole exact fp32 weight [N, K] (the dequantize-at-load path and tests)."""
    return dequantize_rows(w, 0, w.shape[0])


def reference_linear(
    x: torch.Tensor, w: ScaledWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W^T (+ bias)`` in fp32, dequantizing REFERENCE_ROWS output rows at a time
    (never the whole weight); returns x's dtype. Any device."""
    n = w.shape[0]
    xf = x.float()
    out = torch.empty((x.shape[0], n), dtype=torch.float32, device=x.device)
    for start in range(0, n, REFERENCE_ROWS):
        stop = min(n, start + REFERENCE_ROWS)
        out[:, start:stop] = xf @ dequantize_rows(w, start, stop).t()
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def repack(w: ScaledWeight, block: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU kernel's layout (scaled_linear.cpp), a byte transpose of the stored rows:
    values [ceil(N / 16), row bytes, 16] and scales [ceil(N / 16), groups, 16], padding
    columns zero."""
    n = w.shape[0]
    nblk = -(-n // block)
    pad = nblk * block - n

    def blocked(t: torch.Tensor) -> torch.Tensor:
        t = torch.nn.functional.pad(t, (0, 0, 0, pad))
        return t.view(nblk, block, -1).transpose(1, 2).contiguous()

    return blocked(w.data), blocked(w.scale)


def has_nan_values(w: ScaledWeight) -> bool:
    """True where an fp8 value byte is NaN (e4m3 0x7f / 0xff); fp4 codes are never NaN."""
    return w.fmt == "fp8" and bool(((w.data & 0x7F) == 0x7F).any())


def check_finite(w: ScaledWeight) -> bool:
    """False where a value or scale is NaN (e4m3 0x7f / 0xff, ue8m0 0xff) or a scale is
    not finite: the dequantize-at-load path rejects such a tensor too."""
    if w.fmt == "fp8":
        return not has_nan_values(w) and bool(torch.isfinite(w.scale).all())
    return not bool((w.scale == 0xFF).any())


def row_slice(w: ScaledWeight, start: int, stop: int) -> ScaledWeight:
    """Rows [start, stop) of ``w``: a weight of the same K, format and group. Any row
    range is one, since the scales are kept per row (views, no copy). Raises ValueError
    for an empty or out-of-range slice."""
    n = w.shape[0]
    if not 0 <= start < stop <= n:
        raise ValueError(f"rows [{start}, {stop}) are not a non-empty slice of {n} rows")
    return ScaledWeight(w.data[start:stop], w.scale[start:stop], w.fmt, w.in_features, w.group)


def cat_rows(parts: list[ScaledWeight]) -> ScaledWeight | None:
    """Concatenate along N when every part has one format, K and group (else None)."""
    first = parts[0]
    kind = (first.fmt, first.in_features, first.group)
    if any((p.fmt, p.in_features, p.group) != kind for p in parts):
        return None
    data = torch.cat([p.data for p in parts])
    scale = torch.cat([p.scale for p in parts])
    return ScaledWeight(data, scale, first.fmt, first.in_features, first.group)
