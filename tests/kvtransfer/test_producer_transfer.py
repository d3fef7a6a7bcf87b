"""ProducerTransfer: one Prefill call's handle on its transfer (KVProducer.track), each end state
and what it leaves on the producer (its transfer table, the send tracker, early pulls)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.kvtransfer.backend import LoopbackBackend
from pdserve.kvtransfer.connector import KVProducer
from pdserve.kvtransfer.producer_transfer import ProducerTransferState as S
from pdserve.kvtransfer.send_tracker import UnknownTransferError
from pdserve.kvtransfer.transfer_table import DuplicateTransferError


@pytest.fixture
def prod():
    backend = LoopbackBackend()
    released: list[str] = []
    p = KVProducer(backend, [], 4, released.append, lease_s=60.0)
    p.released = released  # type: ignore[attr-defined]
    yield p
    backend.close()


def test_held_then_call_ends_normally_keeps_the_hold(prod):
    t = prod.track("t")
    t.admit()
    prod.on_hold("t", [0, 1], 1, [9])
    assert t.finish() is True and t.state is S.HELD
    t.close(cancelled=False)
    assert "t" in prod.tracker and prod.num_transfers == 1 and prod.released == []


def test_held_then_caller_cancelled_releases_now(prod):
    t = prod.track("t")
    t.admit()
    prod.on_hold("t", [0, 1], 1, [9])
    assert t.finish() is True
    t.close(cancelled=True)  # the router hung up after the answer was ready
    assert t.state is S.CANCELLED and "t" not in prod.tracker and prod.num_transfers == 0
    assert prod.released == ["t"] and prod.aborted_total == 1


def test_nothing_held_ends_failed(prod):
    t = prod.track("t")
    t.admit()
    assert t.finish() is False and t.state is S.FAILED
    assert prod.num_transfers == 0 and prod.ended("t")


@pytest.mark.parametrize("how", ["fail", "cancel"])
def test_failed_or_cancelled_while_prefilling(prod, how):
    t = prod.track("t")
    t.admit()
    getattr(t, how)()
    assert t.state is (S.FAILED if how == "fail" else S.CANCELLED)
    t.close(cancelled=how == "cancel")
    assert prod.num_transfers == 0 and prod.ended("t") and prod.released == []


async def test_refused_before_admission_fails_a_waiting_early_pull(prod):
    waiter = asyncio.create_task(prod.wait_held("t", 30.0))
    await asyncio.sleep(0.02)
    t = prod.track("t")
    t.close(cancelled=False)  # a bad request: the call ended before admit()
    assert t.state is S.REFUSED
    with pytest.raises(UnknownTransferError):
        await asyncio.wait_for(waiter, 2.0)
    assert prod.num_transfers == 0


def test_a_duplicate_is_refused_and_leaves_the_first_alone(prod):
    first = prod.track("t")
    first.admit()
    second = prod.track("t")
    with pytest.raises(DuplicateTransferError):
        second.admit()
    second.close(cancelled=False)
    assert second.state is S.REFUSED and first.state is S.ADMITTED and prod.num_transfers == 1
    prod.on_hold("t", [0], 1, [1])
    assert first.finish() is True
