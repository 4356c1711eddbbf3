"""V4 attention's grouped low-rank output projection (`wo_a`): y[t, g] = W_g x[t, g].

`wo_a` is stored [G R, H D / G] (G = o_groups, R = o_lora_rank): group g's weight W_g
is the row slice [g R, (g + 1) R), itself a linear weight of K = H D / G, applied to the
g-th of G equal slices of a token's attention output. Two ways to hold it:

- block-scaled fp8 / fp4 (`quantized_weights="resident"`): the stored bytes, as G
  `Linear`s over row slices of one `ScaledWeight` (`kernels/scaled.py` `row_slice`; the
  scales are kept per row, so every slice is a whole weight). Each goes through the
  kernels' scaled product, which on the CPU kernels is bitwise the fp32 linear on the
  dequantized slice. G calls, not one: the kernel multiplies one activation matrix by one
  weight, and feeding it all groups' activations against the whole [G R, K] weight would
  compute G times the products to keep 1 / G of them (V4-Flash: G = 8).
- dense (an unquantized checkpoint, `quantized_weights="dequantized"`, a
  tensor-parallel rank's shard of the groups): [G, R, K] in the weight dtype, one batched
  einsum over the groups.
"""

from __future__ import annotations

import torch

from laneserve.kernels import Kernels, scaled
from laneserve.kernels.scaled import ScaledWeight
from laneserve.model.layers.linear import Linear, LinearWeight


class GroupedLinear:
    """G independent linears over equal row slices of one [G R, K] weight."""

    def __init__(self, kernels: Kernels, weight: LinearWeight, groups: int) -> None:
        n, k = (int(s) for s in weight.shape)
        if groups < 1 or n % groups:
            raise ValueError(f"a grouped weight of {n} rows does not split into {groups} groups")
        r = n // groups
        self.shape = (groups, r, k)  # [G, R, K]
        self.dense: torch.Tensor | None = None
        self.parts: list[Linear] = []
        if isinstance(weight, torch.Tensor):
            self.dense = weight.view(groups, r, k)
        elif isinstance(weight, ScaledWeight):
            slices = (scaled.row_slice(weight, g * r, (g + 1) * r) for g in range(groups))
            self.parts = [Linear(kernels, w, None) for w in slices]
        else:
            raise ValueError("a grouped weight must be dense or block-scaled fp8 / fp4")

    def __call__(
        self,
        x: torch.Tensor,  # [T, G, K]
        first_prefill: int | None = None,  # tokens [first_prefill, T) are prompt tokens
    ) -> torch.Tensor:  # [T, G R] in x's dtype
        t = x.shape[0]
        if self.dense is not None:
            y = torch.einsum("tgi,gri->tgr", x.to(self.dense.dtype), self.dense)
            return y.reshape(t, -1).to(x.dtype)
        # x[:, g] is [T, K] with row stride G K: contiguous as it is for one token
        return torch.cat([part(x[:, g], first_prefill) for g, part in enumerate(self.parts)], 1)
