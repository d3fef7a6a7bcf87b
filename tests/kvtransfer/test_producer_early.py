"""KVProducer's early pulls (PushKVRequest.early): a pull that waits for a prefill that may not even
be admitted yet, on the event loop, and the first tokens every push answers with."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from pdserve.kvtransfer.backend import LoopbackBackend
from pdserve.kvtransfer.connector import KVProducer
from pdserve.kvtransfer.regions import regions_for_kv_cache
from pdserve.kvtransfer.send_tracker import UnknownTransferError
from pdserve.kvtransfer.transfer_table import DuplicateTransferError

GEOM = dict(block_size=4, num_kv_heads=2, head_dim=8, elem_bytes=4)
NAMES = ["model.layers.0.self_attn", "model.layers.1.self_attn"]


class _Side:
    """One node's KV tensor (2 layers, 8 blocks) registered with a loopback endpoint."""

    def __init__(self, value: float) -> None:
        per_block = 2 * GEOM["block_size"] * GEOM["num_kv_heads"] * GEOM["head_dim"]
        self.cache = torch.full((8, len(NAMES), per_block), value, dtype=torch.float32)
        self.backend = LoopbackBackend()
        self.backend.register(self.cache.data_ptr(), self.cache.numel() * 4)
        self.regions = regions_for_kv_cache(self.cache.data_ptr(), 8, NAMES, **GEOM)


@pytest.fixture
def env():
    src, dst = _Side(1.0), _Side(0.0)
    released: list[str] = []
    prod = KVProducer(src.backend, src.regions, GEOM["block_size"], released.append, lease_s=60.0)
    yield prod, released, src, dst
    src.backend.close()
    dst.backend.close()


def _hold_later(prod: KVProducer, tid: str, delay_s: float, first: list[int]) -> threading.Thread:
    """on_hold from another thread (the engine thread's part) after ``delay_s``."""

    def run() -> None:
        time.sleep(delay_s)
        prod.on_hold(tid, [0, 1], 1, first)

    t = threading.Thread(target=run)
    t.start()
    return t


async def test_early_waiter_before_admit_is_woken_by_the_hold(env):
    prod, released, _src, dst = env
    waiter = asyncio.create_task(prod.wait_held("t", 10.0))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    prod.admit("t")  # the Prefill arrives after the pull: not a duplicate
    assert not prod.is_ready("t")
    t0 = time.monotonic()
    th = _hold_later(prod, "t", 0.1, [42])
    assert await waiter is True
    assert time.monotonic() - t0 < 2.0
    th.join()
    assert prod.is_ready("t") and prod.first_token_ids("t") == [42]
    res = prod.push("t", [3, 4], 8, dst.regions, dst.backend.session_id, consumer=(0, 0))
    assert res.ok and res.bytes > 0
    assert torch.all(dst.cache[3:5] == 1.0)
    # need_send = 1 reached: freed, and its first tokens with it
    assert released == ["t"] and prod.first_token_ids("t") == [] and not prod._table._transfers


async def test_hold_before_the_early_pull_answers_at_once(env):
    prod, *_ = env
    prod.admit("t")
    prod.on_hold("t", [0, 1], 1, [7, 8])
    assert await asyncio.wait_for(prod.wait_held("t", 10.0), 0.5) is True
    assert prod.first_token_ids("t") == [7, 8]


async def test_many_early_pulls_wait_without_threads(env):
    prod, *_ = env
    threads_before = threading.active_count()
    waiters = [asyncio.create_task(prod.wait_held(f"t{i}", 10.0)) for i in range(200)]
    await asyncio.sleep(0.05)
    assert threading.active_count() == threads_before
    for i in range(200):
        prod.admit(f"t{i}")
    ths = [_hold_later(prod, f"t{i}", 0.0, [i]) for i in range(0, 200, 2)]
    for i in range(1, 200, 2):
        prod.forget(f"t{i}")  # the odd ones' prefill failed
    results = await asyncio.gather(*waiters, return_exceptions=True)
    for th in ths:
        th.join()
    assert all(r is True for r in results[::2])
    assert all(isinstance(r, UnknownTransferError) for r in results[1::2])
    assert [prod.first_token_ids(f"t{i}") for i in (0, 198)] == [[0], [198]]


@pytest.mark.parametrize("end", ["forget", "abort", "refuse_unadmitted"])
async def test_a_prefill_that_ends_without_holding_wakes_the_pull(env, end):
    prod, released, *_ = env
    waiter = asyncio.create_task(prod.wait_held("t", 30.0))
    await asyncio.sleep(0.02)
    if end != "refuse_unadmitted":
        prod.admit("t")
    t0 = time.monotonic()

    def end_it() -> None:  # from another thread, as the engine thread's lease expiry would
        if end == "forget":
            prod.forget("t")
        elif end == "abort":
            assert prod.abort("t") is False  # nothing held: nothing freed
        else:
            prod.refuse("t")  # its Prefill was refused before admission

    threading.Thread(target=end_it).start()
    with pytest.raises(UnknownTransferError, match="ended without holding its KV"):
        await waiter
    assert time.monotonic() - t0 < 2.0
    assert not prod._table._transfers and released == []
    # An early pull that comes after that prefill ended fails at once (its blocks on decode are
    # freed now, not after kv_ready_timeout_s), and leaves nothing behind.
    t0 = time.monotonic()
    with pytest.raises(UnknownTransferError, match="ended without holding its KV"):
        await prod.wait_held("t", 30.0)
    assert time.monotonic() - t0 < 0.5 and not prod._table._transfers and prod.ended("t")
    prod.admit("t")  # nothing of it is left: a new prefill may use the id


@pytest.mark.parametrize("end", ["refused", "forgotten_after_a_pull"])
async def test_an_early_pull_after_its_prefill_ended_fails_at_once(env, end):
    """The router hung up at once: the Prefill RPC ended (refused before admission, or its KV
    held, pulled and freed) before decode's early pull reached this node. The pull does not wait
    out its timeout (decode holds the request's blocks meanwhile); an id never seen still waits."""
    prod, released, _src, dst = env
    if end == "refused":
        prod.refuse("t")
    else:
        prod.admit("t")
        prod.on_hold("t", [0, 1], 1, [7])
        assert prod.push("t", [2, 3], 8, dst.regions, dst.backend.session_id, consumer=(0, 0)).ok
        assert released == ["t"]
    t0 = time.monotonic()
    with pytest.raises(UnknownTransferError, match="ended without holding its KV"):
        await prod.wait_held("t", 30.0)
    assert time.monotonic() - t0 < 0.5 and not prod._table._transfers
    assert await prod.wait_held("other", 0.05) is False  # not ended here: waits (and times out)


async def test_refuse_leaves_an_admitted_transfer_alone(env):
    prod, *_ = env
    prod.admit("t")
    waiter = asyncio.create_task(prod.wait_held("t", 30.0))
    await asyncio.sleep(0.02)
    prod.refuse("t")  # a duplicate Prefill with this id was refused: the first one goes on
    await asyncio.sleep(0.02)
    assert not waiter.done()
    prod.on_hold("t", [0], 1, [5])
    assert await waiter is True


async def test_expired_lease_of_a_held_transfer_frees_its_first_tokens(env):
    prod, released, *_ = env
    prod.admit("t")
    prod.on_hold("t", [0, 1], 1, [3])
    assert prod.tracker.expire(now=time.monotonic() + 120) == ["t"]
    assert released == ["t"] and prod.first_token_ids("t") == [] and not prod._table._transfers


async def test_timeout_leaves_nothing_behind(env):
    prod, *_ = env
    t0 = time.monotonic()
    assert await prod.wait_held("never", 0.1) is False
    assert time.monotonic() - t0 < 1.0
    assert not prod._table._transfers
    with pytest.raises(KeyError):
        prod.is_ready("never")
    # An admitted transfer that is not held in time stays (its Prefill is still running).
    prod.admit("slow")
    assert await prod.wait_held("slow", 0.05) is False
    assert list(prod._table._transfers) == ["slow"]


async def test_timeout_of_one_pull_keeps_the_others_waiting(env):
    prod, *_ = env
    long = asyncio.create_task(prod.wait_held("t", 10.0))
    assert await prod.wait_held("t", 0.05) is False
    assert not long.done() and "t" in prod._table._transfers
    prod.admit("t")
    prod.on_hold("t", [0], 1, [9])
    assert await long is True


async def test_a_cancelled_pull_leaves_nothing_behind(env):
    prod, *_ = env
    waiter = asyncio.create_task(prod.wait_held("t", 10.0))
    await asyncio.sleep(0.02)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not prod._table._transfers


async def test_non_early_lookups_do_not_see_a_transfer_only_early_pulls_wait_for(env):
    prod, *_ = env
    waiter = asyncio.create_task(prod.wait_held("t", 10.0))
    await asyncio.sleep(0.02)
    with pytest.raises(KeyError):  # a plain PushKV answers NOT_FOUND at once, as before
        prod.is_ready("t")
    with pytest.raises(KeyError):
        prod.wait_ready("t", 0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter


async def test_a_real_duplicate_is_still_refused(env):
    prod, *_ = env
    waiter = asyncio.create_task(prod.wait_held("t", 10.0))
    await asyncio.sleep(0.02)
    prod.admit("t")  # the first Prefill: allowed although a pull waits
    with pytest.raises(DuplicateTransferError, match="already in use"):
        prod.admit("t")  # a second Prefill with the same id
    prod.on_hold("t", [0], 1, [1])
    assert await waiter is True
    with pytest.raises(DuplicateTransferError):
        prod.admit("t")  # held
    prod.admit("u")
    with pytest.raises(DuplicateTransferError):
        prod.admit("u")  # admitted, not held yet, no pull waiting


async def test_an_early_pull_whose_prefill_never_comes_fails_after_the_grace(env, monkeypatch):
    """A Prefill never admitted here (cancelled before it was sent, its Abort lost) does not keep
    decode's blocks for the whole timeout: past ADMIT_GRACE_S the pull fails; an admitted one
    whose KV comes later keeps waiting past the grace and gets it."""
    from pdserve.kvtransfer import transfer_table

    monkeypatch.setattr(transfer_table, "ADMIT_GRACE_S", 0.2)
    prod, *_ = env
    t0 = time.monotonic()
    with pytest.raises(UnknownTransferError, match=r"no prefill of it was admitted within 0\.2 s"):
        await prod.wait_held("lost", 30.0)
    assert 0.15 < time.monotonic() - t0 < 2.0 and not prod._table._transfers
    waiter = asyncio.create_task(prod.wait_held("slow", 30.0))
    await asyncio.sleep(0.05)
    prod.admit("slow")
    await asyncio.sleep(0.4)  # past the grace: admitted, so still waiting
    assert not waiter.done()
    prod.on_hold("slow", [0], 1, [9])
    assert await waiter is True and prod.first_token_ids("slow") == [9]
