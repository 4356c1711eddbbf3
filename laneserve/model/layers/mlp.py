"""The gated (SwiGLU) MLP: down(silu(gate) * up), gate|up stored as one weight."""

from __future__ import annotations

import torch

from laneserve.kernels import Kernels
from laneserve.model.layers.linear import Linear, LinearWeight


class GatedMLP:
    def __init__(
        self,
        kernels: Kernels,
        gate_up: LinearWeight,
        down: LinearWeight,
        quantize: str | None = None,
    ) -> None:
        self.kernels = kernels
        self.gate_up = Linear(kernels, gate_up, None, quantize)
        self.down = Linear(kernels, down, None, quantize)

    def __call__(self, x: torch.Tensor, first_prefill: int | None = None) -> torch.Tensor:
        return self.down(self.kernels.silu_and_mul(self.gate_up(x, first_prefill)), first_prefill)
