"""The cache-group kinds' block managers, and the factory the manager uses.

```
 positions      0   4   8   12  16  20  24  28  32  36  40   (block_size 4)
 full           [##][##][##][##][##][##][##][##][##][##][#.  every block kept
 sliding (W=8)  [  ][  ][  ][  ][  ][  ][  ][##][##][##][#.  blocks wholly behind
                                     freed ^ margin ^window    computed - W - margin
 compressed m=4 [ 0  1  2  3 ][ 4  5  6  7 ][ 8  9 10 .  ]   one entry per m tokens,
                                                             block_size entries a block
```
A compressed group is accounted like full attention over blocks of
`block_size x m` token positions. A sliding-window group frees a block once every
position in it lies more than `window + lookahead` below the request's computed count
(`lookahead`: the steps in flight and a speculative rollback may still read that far
back). Freed entries stay in the request's list as None, so later block indexes keep
their meaning; the worker's table keeps the old ids, which no read reaches.
"""

from __future__ import annotations

from laneserve.core.block_pool import BlockHash, BlockPool, KVBlock
from laneserve.kv_cache_interface import COMPRESSED, FULL_ATTENTION, KINDS, SLIDING_WINDOW


class FullAttentionGroup:
    """Every token position keeps its block until the request is freed."""

    def __init__(self, block_size: int, pool: BlockPool) -> None:
        self.block_size = block_size
        self.pool = pool
        self.blocks: dict[int, list[KVBlock]] = {}  # handle -> block list
        self.num_cached: dict[int, int] = {}  # handle -> leading blocks published

    def find_hit(self, hashes: list[BlockHash]) -> list[KVBlock]:
        hit = []
        for h in hashes:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def num_blocks_needed(self, handle: int, num_tokens: int, num_new_computed: int) -> int:
        have = len(self.blocks.get(handle, ())) + num_new_computed
        return max(0, -(-num_tokens // self.block_size) - have)

    def allocate(self, handle: int, hit: list[KVBlock], n_new: int) -> list[int]:
        blocks = self.blocks.setdefault(handle, [])
        if hit:
            self.pool.touch(hit)
            blocks.extend(hit)
            self.num_cached[handle] = len(blocks)
        new = self.pool.get_new_blocks(n_new)
        blocks.extend(new)
        return [b.block_id for b in hit] + [b.block_id for b in new]

    def cache(self, handle: int, hashes: list[BlockHash], num_full_blocks: int) -> None:
        blocks = self.blocks.get(handle, [])
        start = self.num_cached.get(handle, 0)
        for i in range(start, min(num_full_blocks, len(blocks), len(hashes))):
            self.pool.cache_block(blocks[i], hashes[i])
        self.num_cached[handle] = max(start, min(num_full_blocks, len(blocks)))

    def trim(self, handle: int, num_computed: int) -> None:
        """Full attention keeps every block (other kinds free what no query reads)."""

    def free(self, handle: int) -> None:
        blocks = self.blocks.pop(handle, [])
        self.num_cached.pop(handle, None)
        self.pool.free_blocks(reversed(blocks))

    def block_ids(self, handle: int) -> list[int]:
        return [b.block_id for b in self.blocks.get(handle, ())]


class SlidingWindowGroup(FullAttentionGroup):
    def __init__(self, block_size: int, pool: BlockPool, window: int, lookahead: int) -> None:
        super().__init__(block_size, pool)
        self.keep = window + lookahead  # positions below the computed count still read
        self.num_trimmed: dict[int, int] = {}  # handle -> leading blocks freed

    def trim(self, handle: int, num_computed: int) -> None:
        blocks = self.blocks.get(handle)
        if not blocks:
            return
        # block i holds positions [i bs, (i + 1) bs); free it once (i + 1) bs <= first kept
        first_kept = num_computed - self.keep
        upto = min(max(first_kept, 0) // self.block_size, len(blocks) - 1)
        start = self.num_trimmed.get(handle, 0)
        freed: list[KVBlock] = []
        for i in range(start, upto):
            block = blocks[i]
            if block is not None:
                freed.append(block)
                blocks[i] = None  # type: ignore[call-overload]
        if freed:
            self.pool.free_blocks(freed)
        self.num_trimmed[handle] = max(start, upto)

    def num_held(self, handle: int) -> int:
        return sum(1 for b in self.blocks.get(handle, ()) if b is not None)

    def free(self, handle: int) -> None:
        self.num_trimmed.pop(handle, None)
        blocks = [b for b in self.blocks.pop(handle, []) if b is not None]
        self.num_cached.pop(handle, None)
        self.pool.free_blocks(reversed(blocks))

    def block_ids(self, handle: int) -> list[int]:
        # NOTE: -1 for a freed block; only a running request has them, and a resumed
        # one (the only reader of a whole list) was freed and allocated afresh.
        return [b.block_id if b is not None else -1 for b in self.blocks.get(handle, ())]


def make_group(
    kind: str, block_size: int, pool: BlockPool, window: int, lookahead: int
) -> FullAttentionGroup:
    if kind in (FULL_ATTENTION, COMPRESSED):
        return FullAttentionGroup(block_size, pool)
    if kind == SLIDING_WINDOW:
        return SlidingWindowGroup(block_size, pool, window, lookahead)
    raise ValueError(f"unknown cache group kind {kind!r}; known: {list(KINDS)}")
