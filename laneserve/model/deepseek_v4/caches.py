"""One V4 layer's cache tensors and the cache groups they belong to."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerCaches:
    """One layer's cache tensors ([blocks, entries per block, 1, X]) and their groups."""

    swa: torch.Tensor
    swa_group: int
    state: torch.Tensor | None = None  # the compressor's per-token projections
    state_group: int = -1
    entries: torch.Tensor | None = None  # compressed entries
    entries_group: int = -1
