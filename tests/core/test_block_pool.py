"""Block pool and KV cache manager unit tests."""

from __future__ import annotations

import gc

import pytest

from laneserve.core.block_pool import BlockPool, KVBlock, hash_block
from laneserve.core.kv_cache_manager import KVCacheManager
from laneserve.core.request import Request
from laneserve.sampling_params import SamplingParams


def req(handle: int, tokens: list[int]) -> Request:
    return Request(f"r{handle}", handle, tokens, SamplingParams(), (), max_model_len=1024)


def test_hash_chain_depends_on_parent() -> None:
    a = hash_block(None, [1, 2])
    assert hash_block(a, [3, 4]) != hash_block(hash_block(None, [9, 9]), [3, 4])
    assert hash_block(None, [1, 2]) == a and len(a) == 32


def test_lru_eviction_order() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    for i, b in enumerate(blocks):
        pool.cache_block(b, bytes([i]) * 32)
    # free tail-first, as a request does: block 3 is evicted first, block 0 last
    pool.free_blocks(reversed(blocks))
    assert pool.num_free_blocks == 4
    first = pool.get_new_blocks(1)[0]
    assert first is blocks[3] and pool.get_cached_block(bytes([3]) * 32) is None
    assert pool.get_cached_block(bytes([0]) * 32) is blocks[0]
    # a prefix hit revives block 0 (it leaves the free queue) ...
    pool.touch([blocks[0]])
    assert pool.num_free_blocks == 2
    # ... so the next evictions take 2 then 1, never 0
    assert [b.block_id for b in pool.get_new_blocks(2)] == [2, 1]
    assert pool.get_cached_block(bytes([0]) * 32) is blocks[0]


def test_blocks_are_built_on_first_use_and_never_used_ones_go_first() -> None:
    """A pool as large as a CPU budget (~10^5 blocks) builds no block up front, and
    the never-used blocks head the free queue in id order, before every freed one."""
    gc.disable()  # no collection: every object the pool builds stays in generation 0
    try:
        before = len(gc.get_objects(generation=0))
        big = BlockPool(100_000, enable_caching=True)
        built = len(gc.get_objects(generation=0)) - before
    finally:
        gc.enable()
    assert built < 100, built
    assert big.num_free_blocks == 100_000 and big.usage == 0.0
    assert isinstance(big.get_new_blocks(1)[0], KVBlock) and big.num_free_blocks == 99_999
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    assert (a.block_id, b.block_id, pool.num_free_blocks) == (0, 1, 2)
    pool.free_blocks([b, a])  # tail-first: b is evicted before a
    assert [x.block_id for x in pool.get_new_blocks(3)] == [2, 3, 1]
    assert pool.num_free_blocks == 1 and pool.usage == 0.75
    with pytest.raises(RuntimeError, match="asked for 2 blocks, 1 free"):
        pool.get_new_blocks(2)
    assert pool.get_new_blocks(1)[0] is a


def test_ref_counts_and_double_free() -> None:
    pool = BlockPool(2, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    pool.free_blocks([b])
    assert pool.num_free_blocks == 1 and b.ref_cnt == 1
    pool.free_blocks([b])
    assert pool.num_free_blocks == 2
    with pytest.raises(RuntimeError, match="block 0 freed twice"):
        pool.free_blocks([b])
    # the failed free changed nothing: the block stays free exactly once
    assert b.ref_cnt == 0 and pool.num_free_blocks == 2
    assert sorted(x.block_id for x in pool.get_new_blocks(2)) == [0, 1]


def test_first_writer_wins_for_identical_blocks() -> None:
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    h = b"x" * 32
    pool.cache_block(a, h)
    pool.cache_block(b, h)
    assert pool.get_cached_block(h) is a and b.block_hash is None


def test_manager_prefix_hit_leaves_one_token_and_frees_everything() -> None:
    kv = KVCacheManager(["full_attention"], [16], block_size=4, enable_caching=True)
    r1 = req(1, list(range(12)))
    assert kv.allocate_slots(r1, 12) == ([0, 1, 2],)
    r1.num_computed_tokens = 12
    kv.cache_blocks(r1, 12)
    # the same 12 tokens: only 2 blocks may hit (the last token must be computed)
    r2 = req(2, list(range(12)))
    hits, n = kv.get_computed_blocks(r2)
    assert n == 8 and [b.block_id for b in hits[0]] == [0, 1]
    assert kv.allocate_slots(r2, 4, hits) is not None
    assert kv.block_ids(r2)[0][:2] == [0, 1]
    kv.free(r1)
    kv.free(r2)
    assert kv.num_free_blocks == 16


def test_manager_returns_none_when_full() -> None:
    kv = KVCacheManager(["full_attention"], [3], block_size=4, enable_caching=False)
    r = req(1, list(range(10)))
    assert kv.allocate_slots(r, 10) is not None
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 2) == ([],)  # 12 tokens still fit in 3 blocks
    assert kv.allocate_slots(r, 3) is None  # 13 need a 4th
    kv.free(r)
    assert kv.num_free_blocks == 3


def test_multiple_groups_hit_is_the_shortest() -> None:
    kv = KVCacheManager(
        ["full_attention", "full_attention"], [8, 8], block_size=2, enable_caching=True
    )
    r = req(1, [5, 6, 7, 8, 9])
    kv.allocate_slots(r, 5)
    r.num_computed_tokens = 5
    kv.cache_blocks(r, 4)
    kv.groups[1].pool._evict(kv.groups[1].blocks[1][1])  # group 1 lost its 2nd block
    r2 = req(2, [5, 6, 7, 8, 1])
    _, n = kv.get_computed_blocks(r2)
    assert n == 2
    with pytest.raises(ValueError, match="unknown cache group kind"):
        KVCacheManager(["recurrent_state"], [4], block_size=2, enable_caching=True)
