"""KV cache manager: prefix lookup, slot allocation and freeing, per cache group.

A model declares one or more *cache groups* (`kv_cache_interface.CacheGroupSpec`): layers that
share a block layout and a block table. Each group has its own block pool and
a manager for its kind: full attention (every position keeps its KV), and the
kinds of `cache_group_kinds.py` (a sliding window that frees blocks behind it, a
compressed stream with one entry per m tokens). Each has the same methods
(`find_hit`, `num_blocks_needed`, `allocate`, `free`). The scheduler only sees this class:
`allocate_slots` returns None when a group has no room, which means "preempt".
"""

from __future__ import annotations

import logging

from laneserve.core.block_pool import BlockHash, BlockPool, KVBlock, hash_block
from laneserve.core.cache_group_kinds import make_group
from laneserve.core.request import Request
from laneserve.kv_cache_interface import FULL_ATTENTION

log = logging.getLogger(__name__)

BlockIds = tuple[list[int], ...]  # one list per cache group


class KVCacheManager:
    """Block accounting for every cache group.

    `group_block_sizes` (token positions per block, per group; default: `block_size`)
    and `windows` (sliding_window groups) describe the non-full kinds; `lookahead` is
    how far (in tokens) the steps in flight and a speculative rollback may reach below
    a request's computed count, which a sliding window keeps as a margin.
    """

    def __init__(
        self,
        kinds: list[str],
        num_blocks: list[int],
        block_size: int,
        enable_caching: bool,
        group_block_sizes: list[int] | None = None,
        windows: list[int] | None = None,
        lookahead: int = 0,
    ) -> None:
        if enable_caching and any(k != FULL_ATTENTION for k in kinds):
            log.info(
                "prefix caching is off: cache groups of kinds %s keep no per-token KV "
                "for every position of a prefix",
                sorted({k for k in kinds if k != FULL_ATTENTION}),
            )
            enable_caching = False
        self.block_size = block_size
        self.enable_caching = enable_caching
        sizes = group_block_sizes or [block_size] * len(kinds)
        wins = windows or [0] * len(kinds)
        self.groups = [
            make_group(kind, size, BlockPool(n, enable_caching), win, lookahead)
            for kind, n, size, win in zip(kinds, num_blocks, sizes, wins, strict=True)
        ]
        self._hashes: dict[int, list[BlockHash]] = {}
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    # -- queries ---------------------------------------------------------
    @property
    def usage(self) -> float:
        return max(g.pool.usage for g in self.groups)

    @property
    def num_free_blocks(self) -> int:
        return min(g.pool.num_free_blocks for g in self.groups)

    def block_ids(self, req: Request) -> BlockIds:
        return tuple(g.block_ids(req.handle) for g in self.groups)

    # -- prefix cache ----------------------------------------------------
    def block_hashes(self, req: Request, num_tokens: int) -> list[BlockHash]:
        """Hashes of the full blocks among the first `num_tokens` tokens."""
        hashes = self._hashes.setdefault(req.handle, [])
        bs = self.block_size
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, req.all_token_ids[i * bs : (i + 1) * bs]))
        return hashes[: num_tokens // bs]

    def get_computed_blocks(self, req: Request) -> tuple[list[list[KVBlock]], int]:
        """Longest cached prefix, leaving at least one token to compute. None for a
        request that asks for prompt logprobs: every prompt position must be computed."""
        if not self.enable_caching or req.sampling_params.prompt_logprobs is not None:
            return [[] for _ in self.groups], 0
        hashes = self.block_hashes(req, req.num_tokens - 1)
        hits = [g.find_hit(hashes) for g in self.groups]
        n = min(len(h) for h in hits)
        return [h[:n] for h in hits], n * self.block_size

    def cached_prefix_tokens(self, hashes: list[BlockHash]) -> int:
        """Tokens of the chain `hashes` this cache holds now (a read: nothing is taken,
        nothing counted); the data-parallel router compares ranks with it."""
        if not self.enable_caching:
            return 0
        return min(len(g.find_hit(hashes)) for g in self.groups) * self.block_size

    def record_lookup(self, num_tokens: int, num_hit: int) -> None:
        if self.enable_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit

    def cache_blocks(self, req: Request, num_valid_tokens: int) -> None:
        """Publish full blocks whose KV is confirmed (never speculative slots)."""
        if not self.enable_caching:
            return
        n = min(num_valid_tokens, req.num_tokens) // self.block_size
        hashes = self.block_hashes(req, n * self.block_size)
        for g in self.groups:
            g.cache(req.handle, hashes, n)

    # -- allocation ------------------------------------------------------
    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        new_computed: list[list[KVBlock]] | None = None,
    ) -> BlockIds | None:
        """Room for `num_new_tokens` more positions, or None (the caller preempts).

        Returns the block ids appended to each group's table.
        """
        new_computed = new_computed or [[] for _ in self.groups]
        for g in self.groups:
            g.trim(req.handle, req.num_computed_tokens)
        num_hit_tokens = len(new_computed[0]) * self.block_size
        total = req.num_computed_tokens + num_hit_tokens + num_new_tokens
        plans = []
        for g, hit in zip(self.groups, new_computed, strict=True):
            need = g.num_blocks_needed(req.handle, total, len(hit))
            revived = sum(1 for b in hit if b.ref_cnt == 0)  # they leave the free queue
            if need + revived > g.pool.num_free_blocks:
                return None
            plans.append((g, hit, need))
        return tuple(g.allocate(req.handle, hit, need) for g, hit, need in plans)

    def free(self, req: Request) -> None:
        for g in self.groups:
            g.free(req.handle)

    def forget(self, req: Request) -> None:
        """Drop a finished request's cached hashes."""
        self._hashes.pop(req.handle, None)
