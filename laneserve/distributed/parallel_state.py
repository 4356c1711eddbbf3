"""A rank's view of its tensor-parallel group: who it is and the collectives it runs.

No global state: a `TensorParallel` is built once per rank process and handed to the
layers that shard (`model/layers/parallel.py`). `SINGLE` is the one-device value; its
collectives are no-ops, so a TP = 1 model runs exactly the code it ran before.

The all-reduce has a fixed order: every rank gathers all ranks' partial sums and adds
them in rank order, so every rank gets the same bits whatever the timing or the
transport (gloo's and NCCL's own reductions may add in a different order per rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class ShardingError(ValueError):
    """A shape that does not divide by the tensor-parallel size (refused at start)."""


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # the device group (gloo on CPU, NCCL on CUDA); None for SINGLE

    def split(self, n: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's part of `n` (ShardingError when it does not divide)."""
        if n % self.size:
            raise ShardingError(
                f"tensor_parallel_size {self.size} does not divide the model's {what} ({n}); "
                "use a size that divides it"
            )
        part = n // self.size
        return self.rank * part, part

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x`, added in rank order (identical bits on every rank)."""
        if self.size == 1:
            return x
        parts = self._gather(x)
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        return out

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim`, in rank order."""
        if self.size == 1:
            return x
        return torch.cat(self._gather(x), dim=dim)

    def _gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return parts


SINGLE = TensorParallel()
