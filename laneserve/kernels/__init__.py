"""Compute kernels for laneserve: AVX2 CPU kernels with pure-torch fallbacks.

Use :func:`get_kernels` to pick an implementation for a device and keep the returned
object. The contract (shapes, dtypes, batch invariance) is the :class:`Kernels` protocol
in ``base.py``; ``cpu.py`` holds the C++-backed implementation (sources and build beside
it), ``reference.py`` the torch composite one, ``weights.py`` the packed linear weights.
"""

from __future__ import annotations

import torch

from laneserve.kernels.base import BATCH_INVARIANT_MAX_M, Kernels
from laneserve.kernels.build import KernelLib, load_kernels
from laneserve.kernels.cpu import PACK_BLOCK_N, CpuKernels
from laneserve.kernels.reference import TorchKernels
from laneserve.kernels.weights import QUANTIZATIONS, PackedWeight, quantize_int8

__all__ = [
    "BATCH_INVARIANT_MAX_M",
    "PACK_BLOCK_N",
    "QUANTIZATIONS",
    "CpuKernels",
    "KernelLib",
    "Kernels",
    "PackedWeight",
    "TorchKernels",
    "get_kernels",
    "load_kernels",
    "quantize_int8",
]


def get_kernels(device: torch.device, enable: bool = True) -> Kernels:
    """CpuKernels for CPU devices when the extension builds (and ``enable``), else torch."""
    if enable and torch.device(device).type == "cpu":
        lib = load_kernels()
        if lib is not None:
            return CpuKernels(lib)
    return TorchKernels()
