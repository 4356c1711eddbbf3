"""Tensor-parallel layers: each rank holds a slice of a weight and reads only that slice.

```
 kind            weight slice on rank r           forward
 column          rows of W (output features)      x @ W_r^T: this rank's outputs
 merged column   rows of each part (gate | up)    the parts' local outputs, side by side
 QKV             q heads and kv heads of rank r   local heads (GQA: kv heads split too)
 row             columns of W (input features)    all-reduce(x_r @ W_r^T)
 vocab           rows [r V/N, (r+1) V/N)          embedding: all-reduce of the rows it
                                                  holds (others zero); head: all-gather
```
A column-parallel output feeds a row-parallel input directly (attention heads, the
MLP's intermediate features), so a decoder layer costs two all-reduces. Slices come
from the getter's `shard(name, dim, start, length)` where it has one
(`loader.WeightStore` reads only those bytes from the safetensors file), else from
slicing the full tensor. Every split is checked: a size that does not divide raises
`ShardingError` at load, naming what did not divide.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from laneserve.distributed.parallel_state import TensorParallel
from laneserve.kernels import Kernels
from laneserve.model.layers.linear import Linear
from laneserve.model.layers.weights import WeightGetter


def load_shard(get: WeightGetter, name: str, dim: int, start: int, length: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [start, start + length) of tensor `name`."""
    shard = getattr(get, "shard", None)
    if shard is not None:
        return shard(name, dim, start, length)
    return get(name).narrow(dim, start, length).contiguous()


def column_weight(
    get: WeightGetter, parts: list[tuple[str, int, int, str]], tp: TensorParallel
) -> torch.Tensor:
    """This rank's rows of each part, concatenated: part = (name, units, unit_rows, what),
    `units` split across ranks (heads for q / k / v, features for gate / up)."""
    out = []
    for name, units, unit_rows, what in parts:
        start, length = tp.split(units, what)
        out.append(load_shard(get, name, 0, start * unit_rows, length * unit_rows))
    return torch.cat(out) if len(out) > 1 else out[0]


def row_weight(
    get: WeightGetter, name: str, units: int, unit_cols: int, what: str, tp: TensorParallel
) -> torch.Tensor:
    """This rank's columns of `name` (the inputs a column-parallel layer produced)."""
    start, length = tp.split(units, what)
    return load_shard(get, name, 1, start * unit_cols, length * unit_cols)


class RowParallelLinear:
    """y = all-reduce(x_r @ W_r^T): x_r is this rank's slice of the input features."""

    def __init__(self, linear: Linear, tp: TensorParallel) -> None:
        self.linear, self.tp = linear, tp

    def __call__(self, x: torch.Tensor, first_prefill: int | None = None) -> torch.Tensor:
        return self.tp.all_reduce(self.linear(x, first_prefill))


class VocabParallelEmbedding:
    """Rows [start, start + n) of the embedding; other ids give zeros, summed over ranks."""

    def __init__(self, weight: torch.Tensor, start: int, tp: TensorParallel) -> None:
        self.weight, self.start, self.tp = weight, start, tp

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        held = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.tp.all_reduce(rows * held[:, None].to(rows.dtype))


class ParallelLMHead:
    """Logits of this rank's vocabulary rows, gathered: every rank gets all of them."""

    def __init__(self, kernels: Kernels, weight: torch.Tensor, tp: TensorParallel) -> None:
        self.linear, self.tp = Linear(kernels, weight, None), tp

    def __call__(self, x: torch.Tensor, first_prefill: int | None = None) -> torch.Tensor:
        return self.tp.all_gather(self.linear(x, first_prefill), dim=-1)
