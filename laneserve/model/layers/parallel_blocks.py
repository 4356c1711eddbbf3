"""Sharded blocks built from the tensor-parallel layers (`parallel.py`): a gated MLP's
partial sums, the routed experts' slices, the vocabulary-parallel embedding and head.

```
 block            rank r holds                                  output
 gated MLP        gate | up rows of features [r I/N, (r+1) I/N),   partial sum (all-reduce
                  down columns of the same features                it, alone or with others)
 routed expert e  the same split of expert e's moe_intermediate    partial sum per expert
 vocabulary       embedding / LM head rows [r V/N, (r+1) V/N)      all-reduced / all-gathered
```
A block whose output is a partial sum leaves the all-reduce to its caller, so that a
DeepSeek MoE layer adds its routed and shared partial sums locally and reduces once.
"""

from __future__ import annotations

import torch

from laneserve.distributed.parallel_state import TensorParallel
from laneserve.kernels import Kernels
from laneserve.model.layers.mlp import GatedMLP
from laneserve.model.layers.parallel import (
    ParallelLMHead,
    VocabParallelEmbedding,
    column_weight,
    load_shard,
    row_weight,
)
from laneserve.model.layers.weights import WeightGetter


def gated_mlp_shard(
    kernels: Kernels, get: WeightGetter, prefix: str, inter: int, what: str, tp: TensorParallel
) -> GatedMLP:
    """This rank's features of `prefix.{gate,up,down}_proj`: its output is a partial sum."""
    gate_up, down = gated_shard_weights(get, prefix, inter, what, tp)
    return GatedMLP(kernels, gate_up, down)


def gated_shard_weights(
    get: WeightGetter, prefix: str, inter: int, what: str, tp: TensorParallel
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate | up rows [2 I/N, H], down columns [H, I/N]) of this rank's features."""
    parts = [(f"{prefix}.{x}_proj.weight", inter, 1, what) for x in ("gate", "up")]
    down = row_weight(get, f"{prefix}.down_proj.weight", inter, 1, what, tp)
    return column_weight(get, parts, tp), down


def expert_shards(
    get: WeightGetter, prefix: str, experts: int, inter: int, tp: TensorParallel
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each routed expert's slice (release layout `prefix.{e}.{gate,up,down}_proj`):
    gate | up rows of this rank's `moe_intermediate_size` features, down columns of the
    same. Every rank holds a slice of every expert (no expert placement), so each runs
    the same routing on the same tokens and the sums line up."""
    w13, w2 = [], []
    for e in range(experts):
        gate_up, down = gated_shard_weights(
            get, f"{prefix}.{e}", inter, "moe intermediate size", tp
        )
        w13.append(gate_up)
        w2.append(down)
    return w13, w2


def vocab_shard(
    kernels: Kernels, get: WeightGetter, vocab: int, tied: bool, tp: TensorParallel
) -> tuple[torch.Tensor, VocabParallelEmbedding, ParallelLMHead]:
    """This rank's vocabulary rows of the embedding and the LM head (tied: the same)."""
    start, n = tp.split(vocab, "vocabulary size")
    rows = load_shard(get, "model.embed_tokens.weight", 0, start, n)
    head = rows if tied else load_shard(get, "lm_head.weight", 0, start, n)
    return rows, VocabParallelEmbedding(rows, start, tp), ParallelLMHead(kernels, head, tp)


class ReducedMLP:
    """A gated MLP shard whose partial sums are all-reduced (a dense layer's MLP)."""

    def __init__(self, mlp: GatedMLP, tp: TensorParallel) -> None:
        self.mlp, self.tp = mlp, tp

    def __call__(self, x: torch.Tensor, first_prefill: int | None = None) -> torch.Tensor:
        return self.tp.all_reduce(self.mlp(x, first_prefill))
