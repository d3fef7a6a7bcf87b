"""KVConsumer (decode's half of KV transfer) against a fake prefill peer: the record's states, its
removal on every exit, the handshake cache and its renewal on an epoch change, the failure
policy, the checksum, and the keep-alive of queued transfers."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, replace

import pytest

from pdserve.config.choices import KvLoadFailurePolicy
from pdserve.kvtransfer.consumer import KVConsumer
from pdserve.kvtransfer.handshake import HandshakeError, HandshakeInfo
from pdserve.kvtransfer.params import KVLoadSpec, RemotePrefillParams
from pdserve.kvtransfer.peer import KeepAliveReply, PeerCallError, PullReply, PullRequest
from pdserve.kvtransfer.pull_record import TransferState
from pdserve.kvtransfer.regions import Region

ADDR = "10.0.0.1:5000"
HS = HandshakeInfo(
    model_id="m",
    dtype="float32",
    block_size=4,
    layer_names=("a", "b"),
    num_kv_heads=2,
    head_dim=8,
    epoch="e1",
)


@dataclass(frozen=True)
class _Stage:
    pp_rank: int
    pp_size: int
    layer_start: int
    layer_end: int
    session: str
    regions: tuple[Region, ...] = ()
    tp_rank: int = 0
    tp_size: int = 1


class FakePeer:
    """Scripted prefill node: one epoch, answers per transfer id, calls recorded."""

    def __init__(self) -> None:
        self.epoch = "e1"
        self.handshakes = 0
        self.pulls: list[PullRequest] = []
        self.fail_push: dict[str, PeerCallError | PullReply] = {}
        self.gate: asyncio.Event | None = None  # set: push_kv waits for it
        self.keep_alives: list[list[str]] = []
        self.unknown: set[str] = set()
        self.incompatible = False

    async def handshake(self, address: str, info: HandshakeInfo) -> HandshakeInfo:
        self.handshakes += 1
        if self.incompatible:
            return replace(HS, block_size=8, epoch=self.epoch)
        return replace(HS, epoch=self.epoch)

    async def push_kv(self, address: str, request: PullRequest, timeout_s: float) -> PullReply:
        self.pulls.append(request)
        if self.gate is not None:
            await self.gate.wait()
        answer = self.fail_push.get(request.transfer_id)
        if isinstance(answer, PeerCallError):
            raise answer
        if answer is not None:
            return answer
        if request.expected_src_epoch != self.epoch:
            raise PeerCallError(address, "FAILED_PRECONDITION", "prefill restarted")
        return PullReply(ok=True, bytes=100, checksum="d" + request.transfer_id, first_token_ids=(7,))

    async def keep_alive(self, address: str, transfer_ids: list[str], timeout_s: float) -> KeepAliveReply:
        self.keep_alives.append(list(transfer_ids))
        return KeepAliveReply(tuple(t for t in transfer_ids if t in self.unknown), self.epoch)


class Loaded:
    """The engine's side: every finish_kv_load the consumer hands over."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool, str, str, tuple[int, ...]]] = []
        self.event = asyncio.Event()

    def __call__(self, rid: str, ok: bool, policy: str, err: str, first: Sequence[int]) -> None:
        self.calls.append((rid, ok, policy, err, tuple(first)))
        self.event.set()


def _consumer(peer: FakePeer, loaded: Loaded, stages: int = 1, **kw) -> KVConsumer:
    st = [_Stage(i, stages, 2 * i // stages, 2 * (i + 1) // stages, f"s{i}") for i in range(stages)]
    return KVConsumer(peer, HS, st, 4, loaded, keepalive_s=kw.pop("keepalive_s", 30.0), **kw)


def _spec(rid: str, tid: str, num_tokens: int = 6) -> KVLoadSpec:
    return KVLoadSpec(rid, [3, 5, 9], num_tokens, RemotePrefillParams(tid, ADDR))


async def _pull(c: KVConsumer, loaded: Loaded, rid: str, tid: str) -> tuple[str, bool, str, str, tuple]:
    loaded.event.clear()
    c.start_pull(_spec(rid, tid))
    await asyncio.wait_for(loaded.event.wait(), 5)
    return loaded.calls[-1]


async def test_a_pull_moves_waiting_pulling_ready_and_the_record_goes_at_forget():
    peer, loaded = FakePeer(), Loaded()
    c = _consumer(peer, loaded, stages=2)
    rec = await c.open("r1", "t1", ADDR)
    assert rec.state is TransferState.WAITING and c.request_state_sizes()["kv_consumer.transfers"] == 1
    peer.gate = asyncio.Event()
    c.start_pull(_spec("r1", "t1"))
    await asyncio.sleep(0.01)
    assert rec.state is TransferState.PULLING and c.request_state_sizes()["kv_consumer.pulls"] == 1
    peer.gate.set()
    await asyncio.wait_for(loaded.event.wait(), 5)
    assert loaded.calls == [("r1", True, "recompute", "", ())]  # first tokens only for early legs
    assert rec.state is TransferState.READY
    # one PushKV per decode stage, blocks covering 6 tokens of block size 4, the handshook epoch
    assert [(r.dst_pp_rank, r.dst_session, r.dst_block_ids, r.expected_src_epoch) for r in peer.pulls] == [
        (0, "s0", (3, 5), "e1"),
        (1, "s1", (3, 5), "e1"),
    ]
    assert c.stage_pulls == [1, 1] and c.stage_pull_bytes == [100, 100] and c.pull_bytes_total == 200
    c.forget("r1")
    await asyncio.sleep(0)
    assert c.request_state_sizes() == {"kv_consumer.transfers": 0, "kv_consumer.pulls": 0}


async def test_a_refused_handshake_records_nothing():
    peer, loaded = FakePeer(), Loaded()
    peer.incompatible = True
    c = _consumer(peer, loaded)
    with pytest.raises(HandshakeError, match="block_size"):
        await c.open("r1", "t1", ADDR)
    assert len(c.records) == 0


async def test_a_cancelled_open_records_nothing():
    peer, loaded = FakePeer(), Loaded()
    started = asyncio.Event()

    async def slow(address: str, info: HandshakeInfo) -> HandshakeInfo:
        started.set()
        await asyncio.sleep(10)
        return HS

    peer.handshake = slow  # type: ignore[method-assign]
    c = _consumer(peer, loaded)
    task = asyncio.create_task(c.open("r1", "t1", ADDR))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(c.records) == 0


async def test_handshake_is_cached_and_renewed_on_an_epoch_change():
    peer, loaded = FakePeer(), Loaded()
    c = _consumer(peer, loaded)
    await c.open("r1", "t1", ADDR, prefill_epoch="e1")
    await c.open("r2", "t2", ADDR, prefill_epoch="e1")
    assert peer.handshakes == 1
    peer.epoch = "e2"  # prefill restarted; the router's Prefill answer names the new epoch
    await c.open("r3", "t3", ADDR, prefill_epoch="e2")
    assert peer.handshakes == 2 and (await c.peer(ADDR)).epoch == "e2"


async def test_a_stale_peer_fails_the_pull_and_is_handshaken_anew():
    peer, loaded = FakePeer(), Loaded()
    c = _consumer(peer, loaded, policy="fail")
    await c.open("r1", "t1", ADDR)
    peer.epoch = "e2"  # restarted between the open and the pull
    rid, ok, policy, err, _ = await _pull(c, loaded, "r1", "t1")
    assert (rid, ok, policy) == ("r1", False, "fail") and "FAILED_PRECONDITION" in err
    assert c.records.get("r1").state is TransferState.FAILED and c.pull_failures_total == 1
    await c.open("r2", "t2", ADDR)
    assert peer.handshakes == 2  # the stale handshake was dropped
    assert (await _pull(c, loaded, "r2", "t2"))[1] is True


@pytest.mark.parametrize(
    ("policy", "early", "no_recompute", "engine_policy", "reprefill"),
    [
        ("recompute", False, False, "recompute", False),
        ("fail", False, False, "fail", False),
        ("reprefill", False, False, "fail", True),  # the engine fails it; the router re-drives
        ("recompute", True, False, "fail", True),  # no first token here: the router re-drives
        ("recompute", False, True, "fail", False),  # images' tensors not here: cannot recompute
    ],
)
async def test_failure_policy(policy, early, no_recompute, engine_policy, reprefill):
    peer, loaded = FakePeer(), Loaded()
    peer.fail_push["t1"] = PullReply(ok=False, bytes=0)
    c = _consumer(peer, loaded, policy=KvLoadFailurePolicy(policy))
    await c.open("r1", "t1", ADDR, early=early, no_recompute=no_recompute)
    _, ok, got_policy, err, first = await _pull(c, loaded, "r1", "t1")
    assert (ok, got_policy, first) == (False, engine_policy, ())
    assert "reported the write into decode stage 0 as failed" in err
    assert c.wants_reprefill("r1") is reprefill
    assert peer.pulls[0].early is early
    c.forget("r1")
    assert not c.wants_reprefill("r1") and len(c.records) == 0


async def test_an_early_pull_brings_the_first_token_or_fails_without_it():
    peer, loaded = FakePeer(), Loaded()
    c = _consumer(peer, loaded)
    await c.open("r1", "t1", ADDR, early=True)
    assert await _pull(c, loaded, "r1", "t1") == ("r1", True, "fail", "", (7,))
    assert c.early_pulls_total == 1
    await c.open("r2", "t2", ADDR, early=True)
    peer.fail_push["t2"] = PullReply(ok=True, bytes=10)  # no first token
    _, ok, _, err, _ = await _pull(c, loaded, "r2", "t2")
    assert not ok and "without the first token" in err and c.wants_reprefill("r2")


async def test_checksum_match_and_mismatch():
    peer, loaded = FakePeer(), Loaded()
    digests = {"t1": "dt1", "t2": "corrupted"}
    current: list[str] = []

    def local_digest(block_ids: Sequence[int]) -> str:
        assert list(block_ids) == [3, 5]
        return digests[current[0]]

    c = _consumer(peer, loaded, checksum=local_digest, policy="fail")
    for tid, want_ok in (("t1", True), ("t2", False)):
        current[:] = [tid]
        await c.open("r" + tid, tid, ADDR)
        _, ok, _, err, _ = await _pull(c, loaded, "r" + tid, tid)
        assert ok is want_ok and peer.pulls[-1].want_checksum
        assert c.records.get("r" + tid).checksum == "d" + tid
    assert "checksum mismatch for t2" in err
    assert (c.checksums_verified_total, c.checksum_mismatches_total) == (1, 1)


async def test_keep_alive_covers_queued_records_and_expires_what_prefill_lost():
    peer, loaded = FakePeer(), Loaded()
    c = _consumer(peer, loaded, keepalive_s=0.02)
    await c.open("r1", "t1", ADDR)
    await c.open("r2", "t2", ADDR)
    await c.open("r3", "t3", ADDR, early=True)  # its prefill may not hold it yet: not kept alive
    peer.unknown = {"t2"}
    for _ in range(100):
        if peer.keep_alives:
            break
        await asyncio.sleep(0.01)
    assert peer.keep_alives[0] == ["t1", "t2"]
    assert c.records.get("r1").state is TransferState.WAITING
    assert c.records.get("r2").state is TransferState.EXPIRED
    assert (c.keeper.sent_total, c.keeper.unknown_total) == (2, 1)
    # the expired one fails without asking prefill; the policy applies as for any failed pull
    _, ok, policy, err, _ = await _pull(c, loaded, "r2", "t2")
    assert (ok, policy) == (False, "recompute") and "no longer holds t2" in err and not peer.pulls
    assert c.records.get("r2").state is TransferState.FAILED
    # a new epoch in a KeepAlive answer drops the cached handshake
    peer.epoch = "e2"
    n = len(peer.keep_alives)
    while len(peer.keep_alives) == n:
        await asyncio.sleep(0.01)
    await c.open("r4", "t4", ADDR)
    assert peer.handshakes == 2
    # the keeper ends once no record is left
    for rid in ("r1", "r2", "r3", "r4"):
        c.forget(rid)
    await asyncio.sleep(0.1)
    assert c.keeper._task is not None and c.keeper._task.done()


async def test_keep_alive_failure_is_counted_and_kept_going():
    peer, loaded = FakePeer(), Loaded()

    async def down(address: str, transfer_ids: list[str], timeout_s: float) -> KeepAliveReply:
        raise PeerCallError(address, "UNAVAILABLE", "connection refused")

    peer.keep_alive = down  # type: ignore[method-assign]
    c = _consumer(peer, loaded, keepalive_s=0.01)
    await c.open("r1", "t1", ADDR)
    while c.keeper.failures_total < 2:
        await asyncio.sleep(0.01)
    assert c.records.get("r1").state is TransferState.WAITING
    c.forget("r1")
    await c.keeper.stop()


async def test_a_pull_for_a_forgotten_record_still_runs_and_reports():
    peer, loaded = FakePeer(), Loaded()
    c = _consumer(peer, loaded)
    await c.open("r1", "t1", ADDR)
    c.forget("r1")  # the leg ended as the engine handed the pull over
    assert await _pull(c, loaded, "r1", "t1") == ("r1", True, "recompute", "", ())
    assert len(c.records) == 0
