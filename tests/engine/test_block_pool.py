from __future__ import annotations

import pytest

from pdserve.engine.block_pool import BlockPool, hash_block_tokens, hash_prompt_blocks
from pdserve.engine.kv_cache_manager import KVCacheManager, StepFence
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams


def _req(rid: str, ids: list[int]) -> Request:
    return Request(rid, ids, SamplingParams(max_tokens=4))


def test_hash_chains_depend_on_prefix() -> None:
    a = hash_prompt_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = hash_prompt_blocks([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[1] != b[1]  # same second block, different first: different chain
    assert hash_block_tokens(None, [1, 2, 3, 4]) == a[0]


def test_alloc_free_refcount_and_lru_eviction_order() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert pool.num_free_blocks == 1
    for i, b in enumerate(blocks):
        pool.cache_block(b, bytes([i]) * 16)
    pool.touch([blocks[0]])  # shared
    pool.free(reversed(blocks))
    assert blocks[0].ref_cnt == 1 and pool.num_free_blocks == 3
    # Free queue order: the never-used block 3, then blocks[2], blocks[1]; eviction is LRU.
    got = pool.allocate(2)
    assert [b.block_id for b in got] == [3, blocks[2].block_id]
    assert pool.num_cached_blocks == 2 and pool.num_evicted_blocks == 1
    with pytest.raises(AssertionError):
        pool.free([blocks[2], blocks[2], blocks[2]])


def test_blocks_come_into_being_on_first_use() -> None:
    """A pool of millions of blocks costs nothing up front (a tiny model on a big GPU has that
    many); never-used blocks are handed out first, in id order, then freed ones LRU-first."""
    pool = BlockPool(50_000_000)
    assert pool.num_free_blocks == 50_000_000 and pool.num_used_blocks == 0 and len(pool.blocks) == 0
    a = pool.allocate(3)
    pool.free(a[:1])  # block 0 is free again, behind every never-used block
    b = pool.allocate(2)
    assert [x.block_id for x in a + b] == [0, 1, 2, 3, 4]
    assert pool.num_used_blocks == 4 and pool.num_free_blocks == 50_000_000 - 4
    small = BlockPool(3)
    first = small.allocate(3)
    small.free(reversed(first))
    assert [x.block_id for x in small.allocate(3)] == [2, 1, 0] and small.num_free_blocks == 0


def test_prefix_hit_revives_free_cached_block_and_counts() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r1 = _req("a", list(range(10)))
    assert kv.allocate_slots(r1, 10) is not None
    r1.num_computed_tokens = 10
    kv.cache_computed_blocks(r1)
    kv.free("a")
    assert kv.pool.num_used_blocks == 0 and kv.pool.num_cached_blocks == 2
    r2 = _req("b", list(range(8)) + [99, 98, 97])
    hits, n = kv.get_computed_blocks(r2)
    assert n == 8 and len(hits) == 2
    assert kv.allocate_slots(r2, 3, hits, n) is not None
    assert kv.pool.num_used_blocks == 3 and kv.pool.hit_rate > 0
    kv.free("b")
    assert kv.pool.num_used_blocks == 0


def test_full_prompt_hit_leaves_one_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r1 = _req("a", list(range(8)))
    kv.allocate_slots(r1, 8)
    r1.num_computed_tokens = 8
    kv.cache_computed_blocks(r1)
    kv.free("a")
    hits, n = kv.get_computed_blocks(_req("b", list(range(8))))
    assert n == 4 and len(hits) == 1  # the last block is recomputed so logits exist


def test_allocate_failure_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r = _req("a", list(range(12)))
    assert kv.allocate_slots(r, 12) is None
    assert kv.pool.num_free_blocks == 2 and not kv.holds("a")


def test_deferred_free_waits_for_fence() -> None:
    fence = StepFence(completed_seq=3)
    kv = KVCacheManager(num_blocks=4, block_size=4, fence=fence)
    r = _req("a", list(range(8)))
    kv.allocate_slots(r, 8)
    kv.mark_written("a", 5)
    assert not kv.can_free_now("a")
    kv.free("a")
    assert kv.pool.num_used_blocks == 2 and kv.num_deferred_blocks == 2
    assert kv.process_deferred_frees() == 0
    fence.advance(5)
    assert kv.process_deferred_frees() == 2 and kv.pool.num_used_blocks == 0


def test_inflight_write_blocks_free_now() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    r = _req("a", list(range(4)))
    kv.allocate_slots(r, 4)
    kv.begin_inflight_write("a")
    assert not kv.can_free_now("a")
    with pytest.raises(AssertionError):
        kv.free("a")
    kv.end_inflight_write("a")
    kv.free("a")
    assert kv.pool.num_used_blocks == 0
