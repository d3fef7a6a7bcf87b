"""KV events of the offload tier (tier cpu / disk) and the group id, through a real redis-server
into the router's index, where an offload-only block counts ``offload_hit_weight`` of a hit;
the ``kv_events`` settings' checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from pdserve.config.cluster import ClusterConfig
from pdserve.config.kv_events_settings import KVEventsSettings
from pdserve.engine.block_pool import BlockPool
from pdserve.errors import ConfigError
from pdserve.kvevents import stream_key
from pdserve.kvevents.consumer import ConsumerConfig, KVEventConsumer
from pdserve.kvevents.index import DEVICE, OFFLOAD, PrefixIndex
from pdserve.kvevents.publisher import start_publisher
from pdserve.kvoffload.disk import DiskTier
from pdserve.kvoffload.host import HostTier
from pdserve.kvoffload.manager import KVOffloadManager
from tests.kvevents.test_kvevents import BS, _store, _until
from tests.registry.redis_proc import RedisProcess

BB = 32  # the offload tier's block bytes (its payloads are not looked at here)


async def test_offload_tier_events_reach_the_index(redis_proc: RedisProcess, tmp_path: Path) -> None:
    pool = BlockPool(4)
    host = HostTier(memoryview(bytearray(BB * 4)), BB, 4)
    disk = DiskTier(str(tmp_path), 1 << 20, BB)
    mgr = KVOffloadManager(host, disk, BS, host_serves_hits=True, wait_stores=lambda: None)
    pool.on_evict = mgr.on_evict
    settings = KVEventsSettings(flush_interval_s=0.01)
    pub = start_publisher(pool, redis_proc.url, "p0", "e1", BS, settings, offload=mgr)
    index = PrefixIndex()
    consumer = KVEventConsumer(redis_proc.url, index, lambda: ["p0"], ConsumerConfig(read_block_ms=50))
    consumer.start()
    try:
        a = _store(pool, list(range(16)))  # 4 blocks on the device
        b = _store(pool, list(range(100, 116)))  # evicts a's 4 into the host tier
        mgr.take_spec(1)
        mgr.begin_step(1)  # the copies' step completed: the host slots are unpinned
        await _until(lambda: index.weighted_overlap("p0", a, 0.5) == 2.0)
        assert index.overlap("p0", a) == 4 and index.weighted_overlap("p0", b, 0.5) == 4.0
        c = _store(pool, list(range(200, 216)))  # evicts b into the host tier, a moves on to disk
        await _until(lambda: index.weighted_overlap("p0", c, 0.25) == 4.0)
        await _until(lambda: index.weighted_overlap("p0", b, 0.25) == 1.0)
        assert index.weighted_overlap("p0", a, 0.25) == 1.0  # on disk: still an offload hit
        assert index.weighted_overlap("p0", a, 0.0) == 0.0
        tiers = set()
        for _, fields in redis.Redis.from_url(redis_proc.url).xrange(stream_key("p0")):
            for _seq, _kind, _h, _p, _n, group, tier in json.loads(fields[b"data"]).get("events", []):
                assert group == 0  # one block table: the node's one KV cache group
                tiers.add(tier)
        assert tiers == {"device", "cpu", "disk"}

        # A re-sync's snapshot carries every tier of every block.
        pub.request_resync()
        await _until(lambda: consumer.num_resyncs >= 1)
        assert index.weighted_overlap("p0", a, 0.5) == 2.0 and index.overlap("p0", c) == 4
    finally:
        pub.stop()
        await consumer.close()
        disk.close()


def test_index_tiers_combine() -> None:
    index = PrefixIndex()
    index.add("n", b"x", DEVICE)
    index.add("n", b"x", OFFLOAD)
    index.remove("n", b"x", DEVICE)  # evicted from the device, still in the offload tier
    assert index.holds("n", b"x") and index.weighted_overlap("n", [b"x"], 0.5) == 0.5
    index.remove("n", b"x", OFFLOAD)
    assert not index.holds("n", b"x")


def test_kv_events_settings_are_checked() -> None:
    base = {"model": "m", "nodes": [{"name": "d", "role": "decode", "grpc_port": 9000, "metrics_port": 9001}]}
    with pytest.raises(ConfigError, match=r"resync_timeout_s \(0.01\) must exceed"):
        ClusterConfig.from_dict(
            {
                **base,
                "redis_url": "redis://x",
                "kv_events": {"flush_interval_s": 0.05, "resync_timeout_s": 0.01},
            }
        )
    with pytest.raises(ConfigError, match="kv_events is set but redis_url is not"):
        ClusterConfig.from_dict({**base, "kv_events": {"stream_maxlen": 100}})
    with pytest.raises(ConfigError, match=r"unknown field 'flush_interval' in kv_events.*flush_interval_s"):
        ClusterConfig.from_dict({**base, "redis_url": "redis://x", "kv_events": {"flush_interval": 1}})
    with pytest.raises(ConfigError, match=r"kv_events\.stream_maxlen"):
        ClusterConfig.from_dict({**base, "redis_url": "redis://x", "kv_events": {"stream_maxlen": 0}})
    got = ClusterConfig.from_dict({**base, "redis_url": "redis://x", "kv_events": {"redis_timeout_s": 3}})
    assert got.kv_events.redis_timeout_s == 3 and got.kv_events.flush_interval_s == 0.02
    assert ConsumerConfig.from_settings(got.kv_events).redis_timeout_s == 3
