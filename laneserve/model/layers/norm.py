"""RMSNorm through the kernels (plain, and fused with the residual add)."""

from __future__ import annotations

import torch

from laneserve.kernels import Kernels


class RMSNorm:
    def __init__(self, kernels: Kernels, weight: torch.Tensor, eps: float) -> None:
        self.kernels = kernels
        self.weight = weight
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)

    def add_(self, x: torch.Tensor, residual: torch.Tensor) -> None:
        """residual += x; x = norm(residual), both in place."""
        self.kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
