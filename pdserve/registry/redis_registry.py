"""Nodes in Redis: one key per node name, its JSON entry, expiring ``ttl_s`` after the last heartbeat.

    pdserve:node:<name>  ->  {"name", "role", "address", "epoch", "stages", "state"}   PX ttl

A node that stops heartbeating disappears when its key expires (Redis does it, so no clock of
ours is compared with another's). A restarted node registers with a new epoch and overwrites the
key; the old process's next heartbeat sees the foreign epoch and stops (it was replaced).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from pdserve.errors import ConfigError
from pdserve.registry.base import NodeEntry, NodeRegistry, RegistryUnavailableError

KEY_PREFIX = "pdserve:node:"

# Refresh only while the key is absent or still ours: a replaced process must not resurrect itself.
_HEARTBEAT = """
local cur = redis.call('GET', KEYS[1])
if cur and cjson.decode(cur)['epoch'] ~= ARGV[2] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
return 1
"""
_DEREGISTER = """
local cur = redis.call('GET', KEYS[1])
if cur and cjson.decode(cur)['epoch'] == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisRegistry(NodeRegistry):
    dynamic = True

    def __init__(self, url: str, ttl_s: float = 10.0, op_timeout_s: float = 1.0) -> None:
        if ttl_s <= 0:
            raise ConfigError(f"registry_ttl_s must be > 0, got {ttl_s}")
        self.url = url
        self.ttl_s = ttl_s
        # A short socket timeout: a hung Redis must not stall the router's refresh or a heartbeat.
        self._r = aioredis.Redis.from_url(
            url, socket_timeout=op_timeout_s, socket_connect_timeout=op_timeout_s
        )

    @property
    def _ttl_ms(self) -> int:
        return max(1, int(self.ttl_s * 1000))

    async def list_nodes(self) -> list[NodeEntry]:
        with _redis_op(f"node registry {self.url} unreachable"):
            keys = sorted([k async for k in self._r.scan_iter(match=KEY_PREFIX + "*", count=256)])
            values = await self._r.mget(keys) if keys else []
        # A key may expire between SCAN and MGET: skip the hole.
        return [NodeEntry.from_json(v) for v in values if v is not None]

    async def register(self, entry: NodeEntry) -> None:
        with _redis_op(f"cannot register {entry.name} in {self.url}"):
            await self._r.set(KEY_PREFIX + entry.name, entry.to_json(), px=self._ttl_ms)

    async def heartbeat(self, entry: NodeEntry) -> bool:
        with _redis_op(f"heartbeat of {entry.name} to {self.url} failed"):
            ok = await self._r.eval(  # type: ignore[misc]
                _HEARTBEAT, 1, KEY_PREFIX + entry.name, entry.to_json(), entry.epoch, str(self._ttl_ms)
            )
        return bool(ok)

    async def deregister(self, entry: NodeEntry) -> None:
        with _redis_op(f"cannot deregister {entry.name} from {self.url}"):
            await self._r.eval(_DEREGISTER, 1, KEY_PREFIX + entry.name, entry.epoch)  # type: ignore[misc]

    async def close(self) -> None:
        await self._r.aclose()


@contextlib.contextmanager
def _redis_op(failed: str) -> Iterator[None]:
    """One Redis operation: its errors become RegistryUnavailableError, and a cancel it lost is raised.

    redis-py sends each command under ``asyncio.wait_for`` (our socket_timeout), and on Python 3.11
    a cancel that lands after the send finished is dropped there (CPython gh-86296): the command
    returns, or fails, as if nothing happened. Membership's and NodeDiscovery's loops then went on
    beating / polling, and stop() / close(), which cancel and await them, never returned.
    """
    try:
        yield
    except (RedisError, OSError) as e:
        _raise_lost_cancel()
        raise RegistryUnavailableError(f"{failed}: {e}") from e
    _raise_lost_cancel()


def _raise_lost_cancel() -> None:
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
