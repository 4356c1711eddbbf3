"""A pool of fixed-size KV blocks: ref counts, an LRU free queue, a hash map.

A block with ref_cnt == 0 sits in the free queue. If it also holds a hash, its
content is still valid and a prefix lookup may revive it (`touch`); it is
evicted (hash dropped) only when the queue hands it out again. Blocks are
freed tail-first so a request's last blocks are evicted before its prefix.

Block hashes are SHA-256 over (parent hash, token ids): a chain, so a hit on
block i implies the whole prefix matches, and collision-safe, so a hit is
never a guess.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: list[int]) -> BlockHash:
    h = hashlib.sha256(parent or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # NOTE: blocks never handed out (ids _fresh..num_blocks-1) are built on first
        # use: a CPU budget holds ~10^5 blocks and most are never touched. They head
        # the free queue in id order, as if queued at start, before every freed block.
        self._fresh = 0
        # NOTE: insertion order is eviction order (least recently freed first).
        self._free: OrderedDict[int, KVBlock] = OrderedDict()
        self._cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self._fresh + len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            if self._fresh < self.num_blocks:
                block = KVBlock(self._fresh)
                self._fresh += 1
            else:
                _, block = self._free.popitem(last=False)
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on blocks found by a prefix lookup."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks_in_eviction_order: Iterable[KVBlock]) -> None:
        for block in blocks_in_eviction_order:
            # NOTE: a real check, not an assert: a double free under `python -O`
            # would put a block in the free queue while a request still uses it.
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed twice")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Publish a full block's content under its hash (first writer wins)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # an identical block is already published; keep that one
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        if any(b.ref_cnt for b in self._cached.values()):
            return False
        for block in list(self._cached.values()):
            self._evict(block)
        return True

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
