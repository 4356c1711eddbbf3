"""Rotary embeddings: NeoX-style (`Rotary`, the Llama family) and the DeepSeek
family's (`MlaRotary`): yarn scaling and interleaved pairs.

Yarn blends interpolated and extrapolated frequencies with a linear ramp over
the dimensions and scales cos/sin by an attention factor
(`mscale(factor, mscale) / mscale(factor, mscale_all_dim)`); the softmax scale
of MLA is multiplied by `mscale(factor, mscale_all_dim)^2` (see `softmax_scale`).

With `interleave`, the rotated pairs are (x0, x1), (x2, x3), ...; the output
holds the pairs' first elements, then their second ones (q and k alike, so
q . k is unchanged by the layout).
"""

from __future__ import annotations

import math

import torch

from laneserve.kernels import Kernels
from laneserve.model.arch import UnsupportedModelError


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(params: dict, dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2] fp32, cos/sin scale), as transformers computes them."""
    base = float(params.get("rope_theta", 10000.0))
    exps = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    kind = params.get("rope_type", "default")
    if kind == "default":
        return 1.0 / (base**exps), 1.0
    if kind != "yarn":
        raise UnsupportedModelError(f"rope scaling {kind!r} is not supported here (default, yarn)")
    factor = float(params["factor"])
    orig = float(params["original_max_position_embeddings"])
    attn = params.get("attention_factor")
    if attn is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attn = _mscale(factor, m) / _mscale(factor, m_all) if m and m_all else _mscale(factor)
    fast = float(params.get("beta_fast") or 32)
    slow = float(params.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(fast), correction_dim(slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extra = 1 - ramp  # share of the extrapolated frequency per dimension
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float) / dim)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv, float(attn)


def softmax_scale(params: dict, qk_head_dim: int) -> float:
    scale = qk_head_dim**-0.5
    m_all = params.get("mscale_all_dim", 0)
    if params.get("rope_type", "default") != "default" and m_all:
        scale *= _mscale(float(params["factor"]), m_all) ** 2
    return scale


class MlaRotary:
    """cos / sin per position ([max_pos, dim / 2] each) applied to [T, heads, dim]."""

    def __init__(
        self,
        params: dict,
        dim: int,
        max_positions: int,
        interleave: bool,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        inv_freq, attn = rope_frequencies(params, dim)
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]
        self.cos = (freqs.cos() * attn).to(device=device, dtype=dtype)
        self.sin = (freqs.sin() * attn).to(device=device, dtype=dtype)
        self.interleave = interleave

    def __call__(
        self, positions: torch.Tensor, x: torch.Tensor, interleave: bool | None = None
    ) -> torch.Tensor:
        """`interleave` overrides the layout for this call (DeepSeek V3.2's indexer rotates
        half-split pairs with MLA's frequencies)."""
        cos = self.cos.index_select(0, positions)[:, None, :]  # [T, 1, dim / 2]
        sin = self.sin.index_select(0, positions)[:, None, :]
        if self.interleave if interleave is None else interleave:
            a, b = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


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
