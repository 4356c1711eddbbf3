"""GGUF block-quantized linear weights kept quantized: :class:`QuantWeight`, the exact
reference dequantizer and the repacked layout of the native kernel (quant_linear.cpp).

Supported GGUF types (row-major, each output row a run of blocks along K):

======  =====  =====  ===========================================================
type    block  bytes  weight value (all arithmetic fp32, one rounding per op)
======  =====  =====  ===========================================================
q4_0    32     18     ``d * (q - 8)``            q: 4 bits, d: fp16
q4_1    32     20     ``d * q + m``              q: 4 bits, d, m: fp16
q8_0    32     34     ``d * q``                  q: int8, d: fp16
q4_k    256    144    ``(d*sc) * q + (-(dmin*mn))`` per 32-sub-block 6-bit sc / mn
======  =====  =====  ===========================================================

Every type reduces to one *common form* per 32-wide group of an output row: integers
``q``, a scale ``s`` and, for q4_1 / q4_k, an offset ``o`` (all exactly representable in
fp32; for q4_k ``d*sc`` and ``dmin*mn`` are exact products of an fp16 and a 6-bit
integer). The weight is ``s * q`` (+ ``o``): a product and a sum, each rounded once.

NOTE (exactness): :func:`dequantize` computes exactly those values (torch's eager mul and
add round once each, like the kernel's explicit ``mul_ps`` / ``add_ps``; the build has
``-ffp-contract=off``), and the native kernel then runs the fp32 ``linear`` kernel's
per-output FMA chain over k = 0..K-1. So ``linear(x, pack_gguf_weight(qw))`` is bitwise
``linear(x, pack_linear_weight(dequantize(qw)))``: the reference is the fp32 path. These
are also the values the ``gguf`` package's numpy dequantizer produces for these types.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from laneserve.kernels import scaled
from laneserve.kernels.scaled import ScaledWeight

# type -> (elements per block, bytes per block)
GGUF_BLOCKS = {"q4_0": (32, 18), "q4_1": (32, 20), "q8_0": (32, 34), "q4_k": (256, 144)}
QTYPES = tuple(GGUF_BLOCKS)
GROUP = 32  # elements per scale group of the common form (a q4_k sub-block)
PACK_N = 16  # output columns per repacked block (one zmm of fp32)
# repacked layout per type: (scale bytes per column, has offsets, bits per weight)
_LAYOUT = {"q4_0": (2, False, 4), "q4_1": (2, True, 4), "q8_0": (2, False, 8), "q4_k": (4, True, 4)}
QTYPE_CODE = {"q4_0": 0, "q4_1": 1, "q8_0": 2, "q4_k": 3}  # quant_linear.cpp QType


@dataclass(frozen=True)
class QuantWeight:
    """A [N, K] linear weight as GGUF blocks: ``data`` [N, K / block * block_bytes] uint8,
    one output row per tensor row (so rows concatenate and permute like a dense weight)."""

    data: torch.Tensor
    qtype: str
    in_features: int
    # "fp32": multiplied in fp32 (the exact dequantized values, module NOTE); "q8": by
    # activations rounded to int8 per 32 (q8.py, llama.cpp's arithmetic)
    activations: str = "fp32"

    def __post_init__(self) -> None:
        if self.activations not in ("fp32", "q8"):
            raise ValueError(f"activations must be 'fp32' or 'q8', got {self.activations!r}")
        if self.qtype not in GGUF_BLOCKS:
            raise ValueError(f"unsupported GGUF weight type {self.qtype!r}; supported: {QTYPES}")
        block, nbytes = GGUF_BLOCKS[self.qtype]
        if self.in_features % block != 0:
            raise ValueError(f"{self.qtype}: K={self.in_features} is not a multiple of {block}")
        want = self.in_features // block * nbytes
        if self.data.dim() != 2 or self.data.dtype != torch.uint8 or self.data.shape[1] != want:
            raise ValueError(
                f"{self.qtype} weight data must be [N, {want}] uint8, got "
                f"{tuple(self.data.shape)} {self.data.dtype}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.data.shape[0]), self.in_features)


def cat_rows(
    parts: Sequence[torch.Tensor | QuantWeight | ScaledWeight],
) -> torch.Tensor | QuantWeight | ScaledWeight:
    """Concatenate weights along N (fused qkv / gate_up): dense tensors with torch.cat;
    GGUF weights of one type and K by their block rows; block-scaled fp8 / fp4 ones of
    one format by their rows and row scales. Mixed parts are dequantized."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(list(parts))  # type: ignore[arg-type]
    if all(isinstance(p, ScaledWeight) for p in parts):
        cat = scaled.cat_rows(list(parts))  # type: ignore[arg-type]
        if cat is not None:
            return cat
    quant = [p for p in parts if isinstance(p, QuantWeight)]
    kinds = {(q.qtype, q.in_features, q.activations) for q in quant}
    if len(quant) == len(parts) and len(kinds) == 1:
        first = quant[0]
        data = torch.cat([q.data for q in quant])
        return QuantWeight(data, first.qtype, first.in_features, first.activations)
    return torch.cat([_dense(p) for p in parts])


def _dense(p: torch.Tensor | QuantWeight | ScaledWeight) -> torch.Tensor:
    if isinstance(p, QuantWeight):
        return dequantize(p)
    if isinstance(p, ScaledWeight):
        return scaled.dequantize(p)
    return p.float()


def _fp16(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian fp16 -> [...] fp32 (exact)."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16 * j] packed bytes (low nibbles first half, high second) -> [..., 32 * j]."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _q4k_scale_min(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, 12] packed 6-bit scales and mins of a q4_k block -> 2 x [B, 8] int."""
    sc = sc.to(torch.int32)
    d, m, md = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scale = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scale, mins


def common_form(qw: QuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q [N, K] int16, s [N, K/32] fp32, o [N, K/32] fp32 or None): w = s*q (+ o)."""
    n, k = qw.shape
    block, nbytes = GGUF_BLOCKS[qw.qtype]
    b = qw.data.reshape(n * (k // block), nbytes)
    if qw.qtype == "q4_k":
        d, dmin = _fp16(b[:, 0:2]), _fp16(b[:, 2:4])
        sc, mn = _q4k_scale_min(b[:, 4:16])
        s = d[:, None] * sc.float()  # exact: fp16 x 6-bit integer fits fp32
        o = -(dmin[:, None] * mn.float())
        q = _nibbles(b[:, 16:].reshape(-1, 4, 32)).reshape(-1, 256).to(torch.int16)
        return q.reshape(n, k), s.reshape(n, -1), o.reshape(n, -1)
    d = _fp16(b[:, 0:2])
    if qw.qtype == "q8_0":
        q = b[:, 2:].contiguous().view(torch.int8).to(torch.int16)
        return q.reshape(n, k), d.reshape(n, -1), None
    if qw.qtype == "q4_1":
        q = _nibbles(b[:, 4:]).to(torch.int16)
        return q.reshape(n, k), d.reshape(n, -1), _fp16(b[:, 2:4]).reshape(n, -1)
    q = _nibbles(b[:, 2:]).to(torch.int16) - 8  # q4_0
    return q.reshape(n, k), d.reshape(n, -1), None


def dequantize(qw: QuantWeight) -> torch.Tensor:
    """The exact fp32 weight [N, K] the native kernel multiplies by (see the module NOTE)."""
    q, s, o = common_form(qw)
    n, k = qw.shape
    w = q.float().view(n, k // GROUP, GROUP) * s[:, :, None]  # one rounding
    if o is not None:
        w = w + o[:, :, None]  # one rounding
    return w.reshape(n, k)


def repack(qw: QuantWeight) -> torch.Tensor:
    """The native kernel's layout: [ceil(N/16), K/32, record] uint8. A record holds, for
    16 output columns and one 32-wide group of k: the 16 scales (fp16, fp32 for q4_k),
    the 16 offsets (q4_1, q4_k; same dtype), then the quants: 4-bit types as 16 k pairs
    x 16 bytes (byte c = q[2j][c] | q[2j+1][c] << 4, q4_0 stored as q + 8), q8_0 as 32 k
    x 16 int8. Padding columns (N % 16) have q = 0 and zero scale and offset."""
    q, s, o = common_form(qw)
    n, k = qw.shape
    sbytes, has_o, bits = _LAYOUT[qw.qtype]
    nblk, groups = -(-n // PACK_N), k // GROUP
    pad = nblk * PACK_N - n
    if qw.qtype == "q4_0":
        q = q + 8  # back to the stored nibble; the kernel subtracts 8 in integers
    q = torch.nn.functional.pad(q, (0, 0, 0, pad))
    sdt = torch.float16 if sbytes == 2 else torch.float32
    parts = [_column_major(s, pad, nblk, groups).to(sdt).view(torch.uint8)]
    if has_o:
        assert o is not None
        parts.append(_column_major(o, pad, nblk, groups).to(sdt).view(torch.uint8))
    # [nblk, 16, groups, 32] -> [nblk, groups, 32 (k), 16 (column)]
    qg = q.view(nblk, PACK_N, groups, GROUP).permute(0, 2, 3, 1)
    if bits == 4:
        qg = qg.to(torch.uint8).reshape(nblk, groups, GROUP // 2, 2, PACK_N)
        packed = qg[:, :, :, 0] | (qg[:, :, :, 1] << 4)
    else:
        packed = qg.to(torch.int8).view(torch.uint8)
    parts.append(packed.reshape(nblk, groups, -1))
    return torch.cat([p.reshape(nblk, groups, -1) for p in parts], dim=-1).contiguous()


def _column_major(v: torch.Tensor, pad: int, nblk: int, groups: int) -> torch.Tensor:
    """[N, groups] per-row values -> [nblk, groups, 16] (zero padded columns)."""
    v = torch.nn.functional.pad(v, (0, 0, 0, pad))
    return v.view(nblk, PACK_N, groups).transpose(1, 2).contiguous()
