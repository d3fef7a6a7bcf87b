"""KV events through a real redis-server: a BlockPool's publisher, the router's consumer and index."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pdserve.engine.block_pool import BlockPool, hash_prompt_blocks
from pdserve.kvevents.consumer import ConsumerConfig, KVEventConsumer
from pdserve.kvevents.index import PrefixIndex
from pdserve.kvevents.publisher import KVEventPublisher, PublisherConfig
from tests.registry.redis_proc import RedisProcess

BS = 4


def _store(pool: BlockPool, token_ids: list[int]) -> list[bytes]:
    """What the KV cache manager does for one prompt: blocks allocated, then hashed in order."""
    hashes = hash_prompt_blocks(token_ids, BS)
    blocks = pool.allocate(len(hashes))
    for i, (blk, h) in enumerate(zip(blocks, hashes, strict=True)):
        pool.cache_block(blk, h, hashes[i - 1] if i else None)
    pool.free(reversed(blocks))
    return hashes


async def _until(cond: Callable[[], bool], tick: Callable[[], None] = lambda: None) -> None:
    """Wait up to 5 s for ``cond``, calling ``tick`` (the publisher's flush) every 20 ms."""
    deadline = asyncio.get_running_loop().time() + 5.0
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        tick()
        await asyncio.sleep(0.02)


def _cached(pool: BlockPool) -> set[bytes]:
    return {b.block_hash for b in pool.blocks.values() if b.block_hash is not None}


async def test_index_follows_pool_through_eviction_gap_and_restart(redis_proc: RedisProcess) -> None:
    pool = BlockPool(8)
    # The test flushes (its own thread flushes only at stop): it decides what is lost and when.
    cfg = PublisherConfig(flush_interval_s=3600, max_pending_events=64)
    pub = KVEventPublisher(redis_proc.url, "p0", "epoch-1", BS, cfg)
    pub.start()
    pool.listener = pub
    index = PrefixIndex()
    consumer = KVEventConsumer(
        redis_proc.url, index, lambda: ["p0"], ConsumerConfig(read_block_ms=50, resync_timeout_s=0.5)
    )
    consumer.start()
    try:
        a = _store(pool, list(range(16)))  # 4 blocks
        await _until(lambda: index.overlap("p0", a) == 4, pub.flush)
        b = _store(pool, list(range(100, 124)))  # 6 blocks: 2 of a's evicted (LRU, its tail first)
        await _until(lambda: index.overlap("p0", b) == 6, pub.flush)
        assert {h for h in a + b if index.holds("p0", h)} == _cached(pool)
        assert index.overlap("p0", a) == 2
        assert consumer.num_gaps == 0

        # Drop events on purpose: past max_pending_events they are lost (their seq is used).
        pub.cfg = PublisherConfig(flush_interval_s=3600, max_pending_events=2)
        c = _store(pool, list(range(200, 232)))  # 8 blocks: evicts all of b and a
        assert pub.num_dropped > 0
        pub.cfg = cfg
        await _until(lambda: consumer.num_resyncs >= 1, pub.flush)
        await _until(lambda: index.overlap("p0", c) == 8, pub.flush)
        assert consumer.num_gaps >= 1
        assert {h for h in a + b + c if index.holds("p0", h)} == _cached(pool)

        # A restart: a new epoch's all_cleared empties the node's entries.
        pub.stop()
        pool2 = BlockPool(8)
        pub = KVEventPublisher(redis_proc.url, "p0", "epoch-2", BS, cfg)
        pub.start()
        pool2.listener = pub
        await _until(lambda: index.num_blocks("p0") == 0, pub.flush)
        d = _store(pool2, list(range(300, 308)))
        await _until(lambda: index.overlap("p0", d) == 2, pub.flush)
        assert index.num_blocks("p0") == 2
    finally:
        pub.stop()
        await consumer.close()


async def test_node_leaving_the_set_is_dropped(redis_proc: RedisProcess) -> None:
    pool = BlockPool(8)
    pub = KVEventPublisher(redis_proc.url, "d1", "e", BS, PublisherConfig(flush_interval_s=0.01))
    pub.start()
    pool.listener = pub
    live = {"d1"}
    index = PrefixIndex()
    consumer = KVEventConsumer(redis_proc.url, index, lambda: set(live), ConsumerConfig(read_block_ms=50))
    consumer.start()
    try:
        h = _store(pool, list(range(8)))
        await _until(lambda: index.overlap("d1", h) == 2)
        live.clear()
        await _until(lambda: "d1" not in index.nodes())
    finally:
        pub.stop()
        await consumer.close()


def test_index_bound_drops_oldest() -> None:
    index = PrefixIndex(max_blocks_per_node=3)
    for i in range(5):
        index.add("n", bytes([i]))
    assert index.num_blocks("n") == 3
    assert index.num_trimmed == 2
    assert not index.holds("n", b"\x00") and index.holds("n", b"\x04")
    assert index.overlap("n", [b"\x02", b"\x03", b"\x01"]) == 2
