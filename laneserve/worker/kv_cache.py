"""The paged KV cache on the device: block counts per cache group and the tensors.

Per group, one tensor per entry tensor (K and V, or one MLA latent), every layer
stacked: `[layers, blocks, entries per block, *entry_shape]`.

```
 block ids 0 .. n-1        the pool the engine core's block manager hands out
 block id  n               scratch: padded block-table entries point here
 block ids n+1 .. n+extra  the side rows' scratch slots (group 0 only, side_rows.py)
```
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from laneserve.core.kv_cache_manager import CacheGroupSpec

DEFAULT_KV_CACHE_GIB = 2.0

LayerCache = tuple[torch.Tensor, ...]  # one layer's tensors: (K, V) or (latent,)


def num_blocks_for(
    groups: list[CacheGroupSpec],
    budget_bytes: int | None,
    fixed: int | None,
    block_size: int,
    max_model_len: int,
) -> list[int]:
    """Blocks per group. Every group keeps an entry for every token of a request, so a
    budget buys `budget / sum(bytes per token)` tokens, and each group gets the blocks
    that hold that many tokens. `fixed` (a block count) applies to every group."""
    if fixed is not None:
        counts = [fixed for _ in groups]
    else:
        budget = budget_bytes if budget_bytes is not None else int(DEFAULT_KV_CACHE_GIB * 2**30)
        tokens = int(budget // sum(g.bytes_per_token for g in groups))
        counts = [tokens // g.block_size for g in groups]
    least, size = min((n * g.block_size, g.block_size) for n, g in zip(counts, groups, strict=True))
    if least < max_model_len:
        raise ValueError(
            f"the KV cache holds {least // size} blocks = {least} tokens, fewer than "
            f"max_model_len={max_model_len}; raise --kv-cache-memory / --num-kv-blocks "
            "or lower --max-model-len"
        )
    return counts


@dataclass
class KvCache:
    groups: list[CacheGroupSpec]
    num_blocks: list[int]  # per group: the pool (block id num_blocks[g] is its scratch block)
    stacks: list[LayerCache]  # per group: one [L, blocks, entries, *entry_shape] per tensor
    side_base: int  # first side-row scratch slot of group 0 (token index into its blocks)

    @property
    def layers(self) -> list[list[LayerCache]]:
        """Per group, per layer: that layer's cache tensors (views into the stacks)."""
        return [list(zip(*(t.unbind(0) for t in stack), strict=True)) for stack in self.stacks]

    def group_index(self, name: str) -> int | None:
        return next((i for i, g in enumerate(self.groups) if g.name == name), None)

    @staticmethod
    def allocate(
        groups: list[CacheGroupSpec],
        num_blocks: list[int],
        side_slots: int,  # scratch slots for side rows (token-tree alternatives), group 0
        device: torch.device,
        dtype: torch.dtype,
    ) -> KvCache:
        block_size = groups[0].block_size
        extra = [-(-side_slots // block_size)] + [0] * (len(groups) - 1)
        stacks = [
            _allocate_group(g, n + 1 + e, device, dtype)
            for g, n, e in zip(groups, num_blocks, extra, strict=True)
        ]
        return KvCache(groups, num_blocks, stacks, (num_blocks[0] + 1) * block_size)


def _allocate_group(
    group: CacheGroupSpec, blocks: int, device: torch.device, dtype: torch.dtype
) -> LayerCache:
    shape = (group.num_layers, blocks, group.entries_per_block, *group.entry_shape)
    # NOTE: torch.empty: pages are only touched when a block is first written.
    return tuple(
        torch.empty(shape, dtype=dtype, device=device) for _ in range(group.tensors_per_entry)
    )
