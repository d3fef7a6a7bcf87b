"""An encoder stops cleanly when the embedding index (Redis) is already gone."""

from __future__ import annotations

import subprocess
import time

import torch

from pdserve.embedcache.connector import EmbeddingProducer
from pdserve.embedcache.index import EmbeddingIndex
from pdserve.kvtransfer.backend import LoopbackBackend
from tests.embedcache.conftest import _free_port


def test_close_with_redis_gone_does_not_raise_and_clears_its_slots() -> None:
    import redis

    port = _free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        for _ in range(100):
            try:
                redis.Redis.from_url(url).ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        producer = EmbeddingProducer("enc-0", LoopbackBackend(), EmbeddingIndex.from_url(url), 1 << 16, 30.0)
        producer.put("k1", torch.ones(4, 8))
        producer.put("k2", torch.ones(4, 8))
        assert producer.num_cached == 2
    finally:
        proc.terminate()
        proc.wait()
    producer.close()  # Redis is gone: logged, not raised
    assert producer.num_cached == 0
