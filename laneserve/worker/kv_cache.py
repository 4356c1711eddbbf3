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

from laneserve.kv_cache_interface import CacheGroupSpec

DEFAULT_KV_CACHE_GIB = 2.0

LayerCache = tuple[torch.Tensor, ...]  # one layer's tensors: (K, V) or (latent,)


@dataclass(frozen=True)
class StepBounds:
    """What bounds the positions a sliding-window group holds for one request: its
    window, the positions the steps in flight may still read below the computed count
    (`lookahead`) and the most positions one step adds (`step_tokens`), and never more
    than the request's own length (`max_len`)."""

    lookahead: int = 0
    step_tokens: int = 0
    max_num_seqs: int = 1
    max_len: int = 1 << 40  # positions of one request (max_model_len + speculative tokens)

    def held_blocks(self, group: CacheGroupSpec) -> int:
        """The most blocks of `group` (a sliding window) one request holds at once."""
        span = min(group.window + self.lookahead + self.step_tokens, self.max_len)
        return -(-span // group.block_size) + 1  # NOTE: + 1: the span need not align


def num_blocks_for(
    groups: list[CacheGroupSpec],
    budget_bytes: int | None,
    fixed: int | None,
    block_size: int,
    max_model_len: int,
    bounds: StepBounds | None = None,
) -> list[int]:
    """Blocks per group. A budget buys `budget / sum(bytes per token)` token positions
    and each group gets the blocks that hold that many, except that a sliding-window
    group (with `bounds`) gets no more than its running requests can hold at once; the
    bytes it leaves go to the other groups. `fixed` (a block count) applies to every
    group."""
    caps = _sliding_caps(groups, bounds)
    if fixed is not None:
        counts = [fixed for _ in groups]
    else:
        budget = budget_bytes if budget_bytes is not None else int(DEFAULT_KV_CACHE_GIB * 2**30)
        tokens = int(budget // sum(g.bytes_per_token for g in groups))
        counts = [min(tokens // g.block_size, caps.get(i, 1 << 62)) for i, g in enumerate(groups)]
        capped = [i for i in caps if counts[i] < tokens // groups[i].block_size]
        rest = [i for i in range(len(groups)) if i not in capped]
        if capped and rest:  # every group capped (all sliding windows): each keeps its cap
            spent = sum(counts[i] * groups[i].bytes_per_block for i in capped)
            more = int((budget - spent) // sum(groups[i].bytes_per_token for i in rest))
            for i in rest:
                counts[i] = more // groups[i].block_size
    _check_one_request(groups, counts, max_model_len, bounds)
    return counts


def _sliding_caps(groups: list[CacheGroupSpec], bounds: StepBounds | None) -> dict[int, int]:
    if bounds is None:
        return {}
    return {
        i: bounds.max_num_seqs * bounds.held_blocks(g)
        for i, g in enumerate(groups)
        if g.kind == "sliding_window" and g.window > 0
    }


def _check_one_request(
    groups: list[CacheGroupSpec], counts: list[int], max_model_len: int, bounds: StepBounds | None
) -> None:
    """Every group must hold one request of max_model_len (a sliding window: its span)."""
    for g, n in zip(groups, counts, strict=True):
        sliding = bounds is not None and g.kind == "sliding_window" and g.window > 0
        if sliding and bounds is not None:
            if n < bounds.held_blocks(g):
                raise ValueError(
                    f"the KV cache holds {n} blocks for the {g.name!r} window, fewer than one "
                    f"request needs ({bounds.held_blocks(g)}); raise --kv-cache-memory / "
                    "--num-kv-blocks"
                )
        elif n * g.block_size < max_model_len:
            raise ValueError(
                f"the KV cache holds {n} blocks = {n * g.block_size} tokens, fewer than "
                f"max_model_len={max_model_len}; raise --kv-cache-memory / --num-kv-blocks "
                "or lower --max-model-len"
            )


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

    def group_indices(self, names: tuple[str, ...]) -> tuple[int, ...]:
        """The indices of the groups `names` (a draft head's, in its order); each must be
        allocated."""
        found = [self.group_index(name) for name in names]
        assert None not in found, f"cache groups {names} are allocated"
        return tuple(g for g in found if g is not None)

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
