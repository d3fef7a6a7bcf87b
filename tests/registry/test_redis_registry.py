"""The Redis registry against a real redis-server: registration, epochs, TTL, restart; and the
router's discovery on top of it (what leaves rotation, what stays when Redis is gone)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from pdserve.config.cluster import ClusterConfig
from pdserve.errors import ConfigError
from pdserve.registry import NodeEntry, RegistryUnavailableError, registry_for
from pdserve.registry.base import NodeRegistry
from pdserve.registry.membership import Membership
from pdserve.registry.redis_registry import RedisRegistry
from pdserve.registry.static import StaticRegistry
from services.router.discovery import NodeDiscovery
from services.router.pd_backend import PDBackend
from tests.registry.redis_proc import RedisProcess


def cluster(redis_url: str | None, **top: object) -> ClusterConfig:
    return ClusterConfig.from_dict(
        {
            "model": "m",
            "redis_url": redis_url,
            **top,
            "nodes": [
                {"name": "prefill-0", "role": "prefill", "grpc_port": 7001, "metrics_port": 7002},
                {"name": "decode-0", "role": "decode", "grpc_port": 7003, "metrics_port": 7004},
                {"name": "decode-1", "role": "decode", "grpc_port": 7005, "metrics_port": 7006},
            ],
        }
    )


def entry(name: str, epoch: str, role: str = "decode", port: int = 9000) -> NodeEntry:
    return NodeEntry(name=name, role=role, address=f"127.0.0.1:{port}", epoch=epoch)


async def test_register_list_and_a_new_epoch_replaces_the_old(redis_proc: RedisProcess) -> None:
    reg = RedisRegistry(redis_proc.url, ttl_s=30)
    old, new = entry("decode-0", "e1", port=1), entry("decode-0", "e2", port=2)
    await reg.register(old)
    await reg.register(entry("prefill-0", "p1", role="prefill"))
    assert [(e.name, e.epoch) for e in await reg.list_nodes()] == [("decode-0", "e1"), ("prefill-0", "p1")]
    await reg.register(new)  # the restarted process
    assert [e for e in await reg.list_nodes() if e.name == "decode-0"] == [new]
    assert await reg.heartbeat(old) is False  # the old process learns it was replaced ...
    await reg.deregister(old)  # ... and cannot remove the new entry
    assert [e for e in await reg.list_nodes() if e.name == "decode-0"] == [new]
    assert await reg.heartbeat(new) is True
    await reg.deregister(new)
    assert [e.name for e in await reg.list_nodes()] == ["prefill-0"]
    await reg.close()


async def test_replaced_membership_stops_heartbeating_and_keeps_the_new_entry(
    redis_proc: RedisProcess,
) -> None:
    reg = RedisRegistry(redis_proc.url, ttl_s=0.6)
    old = Membership(reg, entry("decode-0", "e1"), heartbeat_s=0.2)
    await old.start()
    new_reg = RedisRegistry(redis_proc.url, ttl_s=0.6)
    new = Membership(new_reg, entry("decode-0", "e2"), heartbeat_s=0.2)
    await new.start()
    await asyncio.sleep(0.5)
    assert old.replaced and not new.replaced
    await old.stop()
    assert [e.epoch for e in await new_reg.list_nodes()] == ["e2"]
    await new.stop()
    probe = RedisRegistry(redis_proc.url)
    assert await probe.list_nodes() == []
    await probe.close()


async def test_a_node_that_stops_heartbeating_leaves_rotation_within_one_ttl(
    redis_proc: RedisProcess,
) -> None:
    ttl_s, interval_s = 1.0, 0.25
    c = cluster(redis_proc.url, registry_ttl_s=ttl_s)
    backend = PDBackend([], [], discovered=True)
    disc = NodeDiscovery(registry_for(c), backend, c, interval_s)
    live = Membership(RedisRegistry(redis_proc.url, ttl_s=ttl_s), entry("decode-0", "a", port=1), ttl_s / 3)
    dying = Membership(RedisRegistry(redis_proc.url, ttl_s=ttl_s), entry("decode-1", "b", port=2), ttl_s / 3)
    await live.start()
    await dying.start()
    disc.start()
    await asyncio.sleep(interval_s * 2)
    assert sorted(h.name for h in backend.decode) == ["decode-0", "decode-1"]
    assert dying._task is not None
    dying._task.cancel()  # the process "dies": no more heartbeats, no deregistration
    t0 = time.monotonic()
    while "decode-1" in {h.name for h in backend.decode}:
        assert time.monotonic() - t0 < ttl_s + interval_s + 0.5, "dead node still in rotation"
        await asyncio.sleep(0.05)
    gone_after_s = time.monotonic() - t0
    # The key's TTL runs from the last beat (<= ttl/3 before the death); the router sees it at its next poll.
    assert gone_after_s <= ttl_s + interval_s + 0.5
    await asyncio.sleep(ttl_s * 1.5)  # the living node's heartbeats keep it in
    assert [h.name for h in backend.decode] == ["decode-0"]
    # live.stop() must return: a cancel that lands in redis-py's wait_for is lost there, so
    # RedisRegistry raises the lost cancel itself and the heartbeat loop ends.
    await live.stop()
    await dying.registry.close()  # dead: no deregistration, but its connection is ours to close
    await disc.close()
    await backend.close()


@pytest.mark.parametrize("then_fails", [False, True])
async def test_a_cancel_lost_inside_redis_py_still_ends_the_heartbeat_loop(
    monkeypatch: pytest.MonkeyPatch, then_fails: bool
) -> None:
    # Python 3.11's asyncio.wait_for, under every redis-py command, drops a cancel that lands as
    # the send completes (CPython gh-86296); this eval drops it the same way, then answers or fails.
    reg = RedisRegistry("redis://127.0.0.1:1/0", ttl_s=1.0)

    async def eval_losing_the_cancel(*_args: object) -> int:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0)
        if then_fails:
            raise RedisConnectionError("connection reset")
        return 1

    monkeypatch.setattr(reg._r, "eval", eval_losing_the_cancel)
    node = Membership(reg, entry("decode-0", "a"), heartbeat_s=0.01)
    node._task = asyncio.get_running_loop().create_task(node._beat())
    await asyncio.wait({node._task}, timeout=2)
    assert node._task.cancelled(), "the heartbeat loop went on after its cancel"
    await reg.close()


async def test_a_cancelled_stop_still_closes_the_connection_and_keeps_the_cancel() -> None:
    """stop()'s caller cancelled while it waits for the heartbeat loop: the cancel reaches the
    caller (it is not swallowed there), and the registry connection is closed anyway."""
    calls: list[str] = []

    class Registry(NodeRegistry):
        async def list_nodes(self) -> list[NodeEntry]:
            return []

        async def register(self, entry: NodeEntry) -> None:
            calls.append("register")

        async def heartbeat(self, entry: NodeEntry) -> bool:
            calls.append("beat")
            return True

        async def deregister(self, entry: NodeEntry) -> None:
            calls.append("deregister")

        async def close(self) -> None:
            calls.append("close")

    node = Membership(Registry(), entry("decode-0", "a"), heartbeat_s=0.01)
    await node.start()
    stopping = asyncio.get_running_loop().create_task(node.stop())
    await asyncio.sleep(0)  # stop() has cancelled the loop and waits for it
    stopping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopping
    assert calls[-1] == "close" and "deregister" not in calls, calls


async def test_draining_entries_leave_rotation_and_strangers_are_ignored(
    redis_proc: RedisProcess, caplog: pytest.LogCaptureFixture
) -> None:
    c = cluster(redis_proc.url)
    reg = RedisRegistry(redis_proc.url, ttl_s=30)
    backend = PDBackend([], [], discovered=True)
    disc = NodeDiscovery(registry_for(c), backend, c, 1.0)
    await reg.register(entry("prefill-0", "p", role="prefill"))
    await reg.register(entry("decode-0", "d"))
    await reg.register(entry("decode-9", "x"))  # not in the cluster file
    await reg.register(entry("decode-1", "y", role="prefill"))  # role differs from the file
    with caplog.at_level(logging.WARNING):
        assert await disc.refresh()
    assert [h.name for h in backend.prefill] == ["prefill-0"]
    assert [h.name for h in backend.decode] == ["decode-0"]
    assert "decode-9" in caplog.text and "decode-1" in caplog.text
    await reg.heartbeat(entry("decode-0", "d").draining())
    await disc.refresh()
    assert backend.decode == []
    await reg.close()
    await disc.close()
    await backend.close()


async def test_redis_going_away_keeps_the_last_known_set_and_recovers(
    redis_proc: RedisProcess, caplog: pytest.LogCaptureFixture
) -> None:
    c = cluster(redis_proc.url, registry_ttl_s=1.0)
    backend = PDBackend([], [], discovered=True)
    disc = NodeDiscovery(registry_for(c), backend, c, 0.25)
    node = Membership(RedisRegistry(redis_proc.url, ttl_s=1.0), entry("decode-0", "a"), 0.2)
    await node.start()
    assert await disc.refresh()
    assert [h.name for h in backend.decode] == ["decode-0"]
    redis_proc.stop()
    with caplog.at_level(logging.WARNING):
        assert not await disc.refresh()
        assert not await disc.refresh()
        await asyncio.sleep(0.5)  # the node's heartbeats fail too; it keeps going
    assert [h.name for h in backend.decode] == ["decode-0"], "last known set must keep serving"
    assert caplog.text.count("node registry unreachable; routing to the last known nodes") == 1
    assert "node registry unreachable, node keeps serving" in caplog.text
    with pytest.raises(RegistryUnavailableError):
        await disc.registry.list_nodes()
    redis_proc.start()  # same port, empty: the restarted Redis lost every key
    await asyncio.sleep(0.5)  # the next heartbeat re-registers the node
    assert await disc.refresh()
    assert [h.name for h in backend.decode] == ["decode-0"]
    assert [e.epoch for e in await disc.registry.list_nodes()] == ["a"]
    await node.stop()
    await disc.close()
    await backend.close()


async def test_static_registry_is_the_file_and_ttl_without_redis_is_refused() -> None:
    c = cluster(None)
    reg = registry_for(c)
    assert isinstance(reg, StaticRegistry) and not reg.dynamic
    assert [(e.name, e.role, e.address) for e in await reg.list_nodes()] == [
        ("decode-0", "decode", "127.0.0.1:7003"),
        ("decode-1", "decode", "127.0.0.1:7005"),
        ("prefill-0", "prefill", "127.0.0.1:7001"),
    ]
    with pytest.raises(ConfigError, match="registry_ttl_s"):
        cluster(None, registry_ttl_s=5)
