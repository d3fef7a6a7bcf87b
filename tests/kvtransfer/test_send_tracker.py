from __future__ import annotations

import threading

import pytest

from pdserve.kvtransfer.send_tracker import KVSendTracker, UnknownTransferError


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def env():
    freed: list[tuple[int, ...]] = []
    clock = FakeClock()
    tracker = KVSendTracker(lambda _tid, ids: freed.append(tuple(ids)), lease_s=30.0, clock=clock)
    return tracker, freed, clock


def test_need_send_two_held_after_first_pull(env):
    # P=4 stages, D=2 stages: each P stage waits for both D stages.
    tracker, freed, _ = env
    tracker.add("t1", [1, 2, 3], need_send=2)
    tracker.begin_send("t1")
    assert tracker.end_send("t1", ok=True) is False
    assert freed == [] and tracker.num_held_blocks == 3
    tracker.begin_send("t1")
    assert tracker.end_send("t1", ok=True) is True
    assert freed == [(1, 2, 3)] and tracker.num_held_blocks == 0
    with pytest.raises(UnknownTransferError, match="t1"):
        tracker.begin_send("t1")


def test_failed_pull_counts_as_report(env):
    tracker, freed, _ = env
    tracker.add("t", [7], need_send=1)
    with pytest.raises(RuntimeError), tracker.sending("t"):
        raise RuntimeError("write failed")
    assert freed == [(7,)]


def test_concurrent_pulls_free_only_when_all_ended(env):
    tracker, freed, _ = env
    tracker.add("t", [1], need_send=1)
    tracker.begin_send("t")
    tracker.begin_send("t")  # e.g. a retry overlapping the first write
    assert tracker.end_send("t", ok=True) is False  # one write still reads the blocks
    assert tracker.end_send("t", ok=True) is True
    assert freed == [(1,)]


def test_unknown_ids(env):
    tracker, _, _ = env
    with pytest.raises(UnknownTransferError):
        tracker.begin_send("nope")
    with pytest.raises(UnknownTransferError):
        tracker.heartbeat("nope")
    assert tracker.abort("nope") is False


def test_lease_expiry_only_when_nothing_in_flight(env):
    tracker, freed, clock = env
    tracker.add("idle", [1, 2], need_send=1)
    tracker.add("busy", [3], need_send=1)
    tracker.begin_send("busy")
    clock.t += 31
    assert tracker.stranded_blocks() == 2
    assert tracker.expire() == ["idle"]
    assert freed == [(1, 2)]
    assert tracker.stranded_blocks() == 0 and "busy" in tracker
    tracker.end_send("busy", ok=True)
    assert freed == [(1, 2), (3,)]


def test_heartbeat_extends_lease(env):
    tracker, freed, clock = env
    tracker.add("t", [1], need_send=1)
    clock.t += 20
    tracker.heartbeat("t")
    clock.t += 20  # 40 s after add, 20 s after the heartbeat
    assert tracker.expire() == []
    clock.t += 11
    assert tracker.expire() == ["t"] and freed == [(1,)]


def test_abort_frees_at_once(env):
    tracker, freed, _ = env
    tracker.add("t", [4, 5], need_send=2)
    assert tracker.abort("t") is True
    assert freed == [(4, 5)]
    assert tracker.abort("t") is False and freed == [(4, 5)]


def test_abort_deferred_while_in_flight(env):
    tracker, freed, clock = env
    tracker.add("t", [4, 5], need_send=2)
    tracker.begin_send("t")
    assert tracker.abort("t") is False
    assert freed == []
    with pytest.raises(UnknownTransferError, match="aborted"):
        tracker.begin_send("t")
    clock.t += 100
    assert tracker.expire() == []  # still in flight
    assert tracker.end_send("t", ok=True) is True  # sent (1) < need_send (2), but aborted
    assert freed == [(4, 5)]
    assert tracker.expire() == [] and tracker.abort("t") is False


def test_free_fn_exactly_once_under_threads():
    calls: list[tuple[int, ...]] = []
    lock = threading.Lock()

    def free(_tid, ids):
        with lock:
            calls.append(tuple(ids))

    tracker = KVSendTracker(free, lease_s=30.0)
    n = 200
    for i in range(n):
        tracker.add(f"t{i}", [i], need_send=4)

    def consumer():
        for i in range(n):
            try:
                with tracker.sending(f"t{i}"):
                    pass
            except UnknownTransferError:
                pass

    def aborter():
        for i in range(0, n, 3):
            tracker.abort(f"t{i}")

    threads = [threading.Thread(target=consumer) for _ in range(4)] + [threading.Thread(target=aborter)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tracker.expire(now=float("inf"))
    assert sorted(calls) == [(i,) for i in range(n)]
    assert tracker.num_held_blocks == 0 and len(tracker) == 0


def test_add_validates(env):
    tracker, _, _ = env
    with pytest.raises(ValueError):
        tracker.add("t", [1], need_send=0)
    tracker.add("t", [1], need_send=1)
    with pytest.raises(ValueError, match="already held"):
        tracker.add("t", [1], need_send=1)
