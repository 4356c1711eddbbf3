"""Small pieces of DeepSeek V4: norms, interleaved partial rope, hyper-connections.

Everything here runs in fp32 whatever the run dtype (transformers keeps these
modules in fp32). The norms and rope are plain torch ops laid out as transformers
computes them; the hyper-connections run as two fused kernels per sublayer
(`Kernels.hyper_pre` / `hyper_post`: one pass per token instead of ~100 small ops, the
Sinkhorn loop included), with the same formulas in fp32.

Hyper-connections (`hc_mult` = N residual streams per token, [T, N, H]):
```
 flat = rms(streams.flatten())                 (no weight)
 pre, post, comb = split(flat @ fn^T) * scale + base
 pre  = sigmoid(pre) + eps          collapse:  x = sum_n pre_n * stream_n
 post = 2 sigmoid(post)             expand:    stream'_n = post_n * f(x) + sum_j comb[j, n] stream_j
 comb = sinkhorn(softmax(comb) + eps)          (rows and columns summing to 1)
```
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from laneserve.kernels.base import Kernels
from laneserve.model.layers.rope import rope_frequencies
from laneserve.model.layers.weights import WeightGetter


def rms_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class Norm:
    """Weighted RMSNorm with the weight applied in fp32, then cast once."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight, self.eps = weight.float(), eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


class InterleavedRope:
    """cos / sin tables [max_pos, rope_dim / 2] of one rope set; rotates the trailing
    `rope_dim` channels of [T, heads, D] in adjacent pairs, in place of them."""

    def __init__(self, params: dict, rope_dim: int, max_positions: int, device: torch.device):
        inv_freq, attn = rope_frequencies(params, rope_dim)
        pos = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = pos[:, None] * inv_freq[None, :]
        self.cos = (freqs.cos() * attn).to(device)
        self.sin = (freqs.sin() * attn).to(device)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False):
        half = self.cos.shape[-1]
        cos = self.cos.index_select(0, positions)[:, None]  # [T, 1, rope_dim / 2]
        sin = self.sin.index_select(0, positions)[:, None]
        if inverse:
            sin = -sin
        pairs = x[..., -2 * half :].unflatten(-1, (half, 2)).float()
        x0, x1 = pairs[..., 0], pairs[..., 1]
        out = x.clone()
        rotated = out[..., -2 * half :].unflatten(-1, (half, 2))
        rotated[..., 0] = x0 * cos - x1 * sin
        rotated[..., 1] = x1 * cos + x0 * sin
        return out


class HyperConnection:
    """The pre / post / comb weights of one block's hyper-connection (see the module doc),
    computed by `Kernels.hyper_pre` and applied by `Kernels.hyper_post`."""

    def __init__(
        self,
        kernels: Kernels,
        get: WeightGetter,
        stem: str,
        n: int,
        iters: int,
        eps: float,
        rms_eps: float,
    ) -> None:
        self.kernels, self.rms_eps = kernels, rms_eps
        self.fn = get(f"{stem}_fn", torch.float32).contiguous()  # [(2 + N) N, N H]
        self.base = get(f"{stem}_base", torch.float32).contiguous()
        self.scale = get(f"{stem}_scale", torch.float32).contiguous()  # [3]
        self.n, self.iters, self.eps = n, iters, eps

    def __call__(self, streams: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """streams [T, N, H] -> post [T, N], comb [T, N, N], collapsed [T, H]."""
        return self.kernels.hyper_pre(
            streams, self.fn, self.base, self.scale, self.iters, self.eps, self.rms_eps
        )

    def expand(
        self, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor
    ) -> torch.Tensor:
        """stream'_n = post_n * out + sum_j comb[j, n] * stream_j."""
        return self.kernels.hyper_post(streams, out, post, comb)


class HyperHead:
    """The final collapse of the N streams into one hidden state per token."""

    def __init__(self, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float):
        self.fn, self.base, self.scale, self.eps = fn.float(), base.float(), scale.float(), eps

    def __call__(self, streams: torch.Tensor, rms_eps: float) -> torch.Tensor:
        t = streams.shape[0]
        mixes = F.linear(rms_unweighted(streams.reshape(t, -1).float(), rms_eps), self.fn)
        pre = torch.sigmoid(mixes * self.scale + self.base) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
