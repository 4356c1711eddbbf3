"""Tensor parallelism of DeepSeek V4 (docs/distributed.md): which slice a rank loads.

Rank r of N holds (heads and output groups split as DeepSeek's own V4 inference code
does, the indexer replicated as vLLM's sparse-attention indexer is):
```
 attention  query heads [r H/N, (r+1) H/N): wq_b rows, attn_sink entries, and the
            output groups [r G/N, (r+1) G/N) those heads form: wo_a rows, wo_b
            columns (all-reduce after wo_b)
            wq_a, q_norm, wkv, kv_norm, compressors, indexer: whole, so every rank
            computes (and caches) the one K = V head every query head reads, the
            compressed entries and the indexer's top-k (one score over all its heads)
 MoE        features [r I/N, (r+1) I/N) of every routed expert and of the shared
            expert: w1 / w3 rows, w2 columns; routed + shared partial sums added on
            the rank, then one all-reduce; the gate (bias, tid2eid) whole, in fp32
 vocab      embedding and head rows [r V/N, (r+1) V/N) (all-reduce, all-gather)
```
Hyper-connections and norms are whole on every rank. With N = 1 every tensor is read
with the getter as before (`rows` / `cols` read the whole tensor).
"""

from __future__ import annotations

import torch

from laneserve.distributed.parallel_state import TensorParallel
from laneserve.model.arch import ArchConfig
from laneserve.model.layers.weights import WeightGetter

HEADS = "attention heads"
GROUPS = "output groups (o_groups)"
FEATURES = "MoE intermediate size"
VOCAB = "vocabulary size"


def parallel_sizes(arch: ArchConfig) -> dict[str, int]:
    """What tensor parallelism splits, by name: each must divide by the TP size."""
    assert arch.v4 is not None, "not a DeepSeek V4 architecture"
    return {
        HEADS: arch.num_heads,
        GROUPS: arch.v4.o_groups,
        FEATURES: arch.v4.moe_intermediate_size,
        VOCAB: arch.vocab_size,
    }


def _part(
    get: WeightGetter, name: str, dim: int, start: int, length: int, dtype: torch.dtype | None
) -> torch.Tensor:
    shard = getattr(get, "shard", None)
    if shard is not None:
        return shard(name, dim, start, length, dtype)
    return _whole(get, name, dtype).narrow(dim, start, length).contiguous()


def _whole(get: WeightGetter, name: str, dtype: torch.dtype | None) -> torch.Tensor:
    return get(name) if dtype is None else get(name, dtype)


def rows(
    get: WeightGetter,
    name: str,
    units: int,
    unit_rows: int,
    what: str,
    tp: TensorParallel,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """This rank's rows of `name`: `units` (heads, groups, features) split over the
    ranks, `unit_rows` rows each; the whole tensor, as `get` reads it, for one rank."""
    if tp.size == 1:
        return _whole(get, name, dtype)
    start, length = tp.split(units, what)
    return _part(get, name, 0, start * unit_rows, length * unit_rows, dtype)


def cols(
    get: WeightGetter, name: str, units: int, unit_cols: int, what: str, tp: TensorParallel
) -> torch.Tensor:
    """This rank's columns of `name` (the inputs a row-split producer gave it)."""
    if tp.size == 1:
        return get(name)
    start, length = tp.split(units, what)
    return _part(get, name, 1, start * unit_cols, length * unit_cols, None)
