"""GGUF weights with int8 activations (``--gguf-weights q8-dot``): the activation
quantizer, the layout of the native kernel (quant_linear_q8.cpp) and its exact torch
reference.

llama.cpp multiplies its 4-bit weights by activations rounded to 8 bits per 32-wide group
(integer dot products, one float scale per group). This module defines that arithmetic
precisely, so that the AVX-512 VNNI kernel and :func:`reference_linear` give the same bits:

* **Activations**, per row and group of 32 (:func:`quantize_rows`): ``amax = max |x|``;
  a non-finite ``amax`` makes the group NaN; ``amax <= 1e-30`` makes it zero; otherwise
  ``q = round_half_even(x * (127 / amax))``, ``dx = amax / 127``, ``sx = dx * sum(q)``.
* **Weights**: quant.py's common form per 32 k, integers ``q_w`` with a scale ``s`` and,
  for q4_1 / q4_k, an offset ``o``.
* **Output**: ``t_g = sum_k q_w q`` per group (exact integers), then
  ``acc = acc + (t_g * dx_g) * s_g`` [``+ sx_g * o_g``] over the groups in order from 0,
  one fp32 rounding per operation, then ``+ bias``.

Each row's result depends on that row only, so the path is batch invariant like the fp32
kernels. It is not the fp32 arithmetic of ``--gguf-weights quantized``: rounding the
activations to 8 bits changes results by about 1 % of a dot product's magnitude.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from laneserve.kernels.quant import (
    _LAYOUT,
    GROUP,
    PACK_N,
    QuantWeight,
    _column_major,
    common_form,
)

TORCH_LAYOUT_SUFFIX = "-q8-torch"  # TorchKernels' layout of such weights: the common form
TINY = 1e-30  # groups whose amax is at or below this are zero
# Added to the weight integers so that vpdpbusd's unsigned operand holds them (q4_0 is
# stored as q + 8 in GGUF; q8_0's int8 becomes q + 128).
ZERO_POINT = {"q4_0": 8, "q4_1": 0, "q8_0": 128, "q4_k": 0}


def quantize_rows(
    x: torch.Tensor,  # [M, K] float32, K a multiple of 32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [M, K] int8, dx [M, K/32] fp32, sx [M, K/32] fp32, sum(q) [M, K/32] int32), the
    operations of quant_linear_q8.cpp ``quantize_group`` in the same fp32 order."""
    m, k = x.shape
    xg = x.float().reshape(m, k // GROUP, GROUP)
    amax = xg.abs().amax(dim=-1)
    bad = ~torch.isfinite(amax)
    zero = bad | (amax <= torch.tensor(TINY, dtype=torch.float32))
    safe = torch.where(zero, torch.ones_like(amax), amax)
    inv = torch.tensor(127.0, dtype=torch.float32) / safe
    q = torch.round(xg * inv[..., None])
    q = torch.where(zero[..., None], torch.zeros_like(q), q).to(torch.int32)
    sq = q.sum(dim=-1, dtype=torch.int32)
    dx = safe / torch.tensor(127.0, dtype=torch.float32)
    dx = torch.where(zero, torch.zeros_like(dx), dx)
    dx = torch.where(bad, torch.full_like(dx, float("nan")), dx)
    sx = dx * sq.float()
    return q.to(torch.int8).reshape(m, k), dx, sx, sq


def repack(qw: QuantWeight) -> torch.Tensor:
    """The native kernel's layout: [ceil(N/16), K/32, record] uint8. A record holds, for 16
    output columns and one 32-wide group of k: 16 scales (fp16, fp32 for q4_k), 16 offsets
    (q4_1, q4_k), then the unsigned integers u = q + ZERO_POINT in vpdpbusd order: 4-bit
    types as 4 chunks of 64 B, byte (c, j) of chunk i = u[4i + j][c] | u[16 + 4i + j][c] << 4;
    q8_0 as 8 chunks, byte (c, j) of chunk i = u[4i + j][c]. Padding columns are zero."""
    q, s, o = common_form(qw)
    n, k = qw.shape
    nblk, groups = -(-n // PACK_N), k // GROUP
    pad = nblk * PACK_N - n
    u = F.pad(q + ZERO_POINT[qw.qtype], (0, 0, 0, pad)).to(torch.uint8)
    # [nblk, 16 (c), groups, 32 (k)] -> [nblk, groups, 32 (k), 16 (c)]
    ug = u.view(nblk, PACK_N, groups, GROUP).permute(0, 2, 3, 1)
    if qw.qtype == "q8_0":
        quants = ug.reshape(nblk, groups, 8, 4, PACK_N).transpose(3, 4)  # (i, c, j)
    else:
        halves = ug.reshape(nblk, groups, 2, 4, 4, PACK_N).transpose(4, 5)  # (h, i, c, j)
        quants = halves[:, :, 0] | (halves[:, :, 1] << 4)
    sdt = torch.float16 if _LAYOUT[qw.qtype][0] == 2 else torch.float32  # as quant.repack
    parts = [_column_major(s, pad, nblk, groups).to(sdt).view(torch.uint8)]
    if o is not None:
        parts.append(_column_major(o, pad, nblk, groups).to(sdt).view(torch.uint8))
    parts.append(quants.reshape(nblk, groups, -1))
    return torch.cat([p.reshape(nblk, groups, -1) for p in parts], dim=-1).contiguous()


def record_bytes(qtype: str) -> int:
    """Bytes per record of :func:`repack` (per 16 columns x 32 k), from quant.py's table."""
    sbytes, has_offset, bits = _LAYOUT[qtype]
    return (2 if has_offset else 1) * sbytes * PACK_N + GROUP * PACK_N * bits // 8


def reference_linear(
    x: torch.Tensor,  # [M, K] float32
    q: torch.Tensor,  # [N, K] the weight integers (common form)
    s: torch.Tensor,  # [N, K/32] fp32
    o: torch.Tensor | None,  # [N, K/32] fp32 or None
    bias: torch.Tensor | None = None,  # [N] float32
) -> torch.Tensor:  # [M, N] float32
    """The module's arithmetic in torch, bit for bit what quant_linear_q8 computes."""
    m, k = x.shape
    groups = k // GROUP
    qx, dx, sx, _ = quantize_rows(x)
    # exact integer group sums: products < 2^15, 32 of them, well inside float64's 53 bits
    xg = qx.view(m, groups, GROUP).double()
    wg = q.view(-1, groups, GROUP).double()
    t = torch.einsum("mgk,ngk->gmn", xg, wg).float()  # exact: |t| < 2^24
    acc = torch.zeros(m, q.shape[0], dtype=torch.float32)
    for g in range(groups):
        acc = acc + (t[g] * dx[:, g, None]) * s[None, :, g]
        if o is not None:
            acc = acc + sx[:, g, None] * o[None, :, g]
    return acc if bias is None else acc + bias.float()
