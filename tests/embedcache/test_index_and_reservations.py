"""Embedding-cache index against a real redis-server; consumer reservations (pure, fake clock)."""

from __future__ import annotations

import time

import pytest

from pdserve.embedcache.index import EmbeddingEntry, EmbeddingIndex
from pdserve.embedcache.reservation import ReservationState, ReservationTable
from pdserve.errors import CapacityError


def _entry(key: str) -> EmbeddingEntry:
    return EmbeddingEntry(key, "encoder-0", "127.0.0.1:17000", 4096, 16 * 64 * 4, "float32", (16, 64))


def test_publish_lookup_expire(redis_url: str) -> None:
    idx = EmbeddingIndex.from_url(redis_url, prefix="t1:")
    idx.publish(_entry("abc"), ttl_s=0.3)
    assert idx.lookup("abc") == _entry("abc")
    assert idx.keys() == ["abc"]
    assert idx.client.pttl("t1:abc") > 0, "every entry carries an expiry"
    assert idx.refresh("abc", 0.3)
    time.sleep(0.5)
    assert idx.lookup("abc") is None and idx.keys() == [], "the entry expires with its lease"
    assert not idx.refresh("abc", 1.0)


def test_remove_and_bad_dtype(redis_url: str) -> None:
    idx = EmbeddingIndex.from_url(redis_url, prefix="t2:")
    idx.publish(_entry("k"), ttl_s=30)
    idx.remove("k")
    assert idx.lookup("k") is None
    with pytest.raises(ValueError, match="int8"):
        EmbeddingEntry("k", "e", "a", 0, 16, "int8", (4, 4))


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_reservation_states_and_first_fit() -> None:
    tab = ReservationTable(100, lease_s=10, clock=_Clock())
    a, b = tab.reserve("a", 40), tab.reserve("b", 40)
    assert (a.offset, b.offset) == (0, 40)
    with pytest.raises(CapacityError, match="no room for 30 bytes"):
        tab.reserve("c", 30)
    assert tab.take(a.rid) is None, "only READY may be taken"
    assert tab.begin_write(a.rid) and a.state is ReservationState.WRITING
    assert tab.finish_write(a.rid, ok=True) and a.state is ReservationState.READY
    assert tab.take(a.rid) is a and a.state is ReservationState.TAKEN
    tab.release(a.rid)
    assert tab.reserve("c", 30).offset == 0, "freed room is reused"


def test_lease_never_frees_an_active_writer() -> None:
    clock = _Clock()
    tab = ReservationTable(100, lease_s=5, clock=clock)
    idle, writing, ready = tab.reserve("idle", 10), tab.reserve("w", 10), tab.reserve("r", 10)
    tab.begin_write(writing.rid)
    tab.begin_write(ready.rid)
    tab.finish_write(ready.rid, ok=True)
    clock.t = 6
    assert tab.expire() == 3 and tab.num_expired == 3
    assert tab.num_reserved == 1, "only the active writer's buffer is kept"
    assert not tab.begin_write(idle.rid), "an expired reservation cannot be written"
    assert tab.finish_write(writing.rid, ok=True) is False, "the late writer learns it expired"
    assert tab.num_reserved == 0


def test_release_during_write_frees_after_writer() -> None:
    tab = ReservationTable(100, lease_s=5, clock=_Clock())
    r = tab.reserve("x", 10)
    tab.begin_write(r.rid)
    tab.release(r.rid)  # the request died mid-write
    assert tab.num_reserved == 1
    assert tab.finish_write(r.rid, ok=True) is False and tab.num_reserved == 0


def test_consumer_counts_reservation_expiries() -> None:
    from pdserve.embedcache.connector import EmbeddingConsumer
    from pdserve.kvtransfer.backend import LoopbackBackend

    consumer = EmbeddingConsumer(LoopbackBackend(), 1 << 12, lease_s=0.05)
    r, dst = consumer.reserve(EmbeddingEntry("k", "e", "a", 0, 64, "float32", (4, 4)))
    assert dst == consumer.base + r.offset
    time.sleep(0.1)
    assert consumer.expire() == 1 and consumer.reservation_expiries._value.get() == 1
    assert consumer.table.num_reserved == 0
