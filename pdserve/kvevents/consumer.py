"""The router's KV event consumer: follows each node's stream into a ``PrefixIndex``.

Per node it keeps the stream position, the node's epoch and the next seq it expects. A seq past
that one is a gap (events were dropped): the node's entries stay as they are (slightly stale is
harmless for routing), a re-sync is asked for, and events are skipped until the node's snapshot
comes (asked again every ``resync_timeout_s``). A node that leaves ``nodes()`` (the registry's
serving set) is dropped from the index at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from pdserve.config.kv_events_settings import KVEventsSettings
from pdserve.kvevents import resync_key, stream_key
from pdserve.kvevents.index import PrefixIndex, tier_bit

logger = logging.getLogger(__name__)
RESYNC_KEY_TTL_S = 60


@dataclass(frozen=True)
class ConsumerConfig:
    read_block_ms: int = 200  # one XREAD waits this long for new entries
    read_count: int = 256  # entries per stream and read
    resync_timeout_s: float = 2.0  # a snapshot not seen by then is asked for again
    redis_timeout_s: float = 1.0  # connect / answer of one Redis operation (besides the XREAD wait)
    retry_s: float = 1.0  # after a failed read

    @classmethod
    def from_settings(cls, s: KVEventsSettings) -> ConsumerConfig:
        """The cluster file's ``kv_events`` section (pdserve/config/kv_events_settings.py)."""
        return cls(
            read_block_ms=s.read_block_ms,
            resync_timeout_s=s.resync_timeout_s,
            redis_timeout_s=s.redis_timeout_s,
            retry_s=s.retry_s,
        )


@dataclass
class _Follow:
    last_id: str = "0-0"
    epoch: str = ""
    next_seq: int = 0
    resync_asked_at: float | None = None  # waiting for a snapshot since (loop time)


class KVEventConsumer:
    def __init__(
        self, redis_url: str, index: PrefixIndex, nodes: Callable[[], Iterable[str]], cfg: ConsumerConfig
    ) -> None:
        self.index, self.nodes, self.cfg = index, nodes, cfg
        self._r = aioredis.Redis.from_url(
            redis_url,
            socket_timeout=cfg.read_block_ms / 1000 + cfg.redis_timeout_s,
            socket_connect_timeout=cfg.redis_timeout_s,
        )
        self._follow: dict[str, _Follow] = {}
        self._task: asyncio.Task[None] | None = None
        self._reachable = True
        self.num_gaps = 0  # seq jumps seen (each asks for a re-sync)
        self.num_resyncs = 0  # snapshots applied
        self.num_events = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._r.aclose()

    async def _run(self) -> None:
        while True:
            try:
                await self.poll_once()
                if not self._reachable:
                    logger.info("KV events: Redis reachable again")
                self._reachable = True
            except (RedisError, OSError) as e:
                if self._reachable:
                    logger.warning("KV events: Redis unreachable, prefix index frozen: %s", e)
                self._reachable = False
                await asyncio.sleep(self.cfg.retry_s)

    async def poll_once(self) -> None:
        """Follow the current node set; read and apply one round of entries."""
        names = set(self.nodes())
        for gone in set(self._follow) - names:
            del self._follow[gone]
            self.index.drop_node(gone)
        for new in names - set(self._follow):
            self._follow[new] = _Follow()
        if not self._follow:
            await asyncio.sleep(self.cfg.read_block_ms / 1000)
            return
        now = asyncio.get_running_loop().time()
        for name, f in self._follow.items():
            if f.resync_asked_at is not None and now - f.resync_asked_at > self.cfg.resync_timeout_s:
                await self._ask_resync(name, f)
        streams = {stream_key(n): f.last_id for n, f in self._follow.items()}
        got: Any = await self._r.xread(streams, count=self.cfg.read_count, block=self.cfg.read_block_ms)  # type: ignore[arg-type]
        for key, entries in got or []:
            name = (key.decode() if isinstance(key, bytes) else str(key)).removeprefix(stream_key(""))
            follow = self._follow.get(name)
            if follow is None:
                continue
            for entry_id, fields in entries:
                follow.last_id = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                await self._apply(name, follow, fields)

    async def _apply(self, name: str, f: _Follow, fields: dict[bytes, bytes]) -> None:
        epoch = fields[b"epoch"].decode()
        data = json.loads(fields[b"data"])
        if epoch != f.epoch:  # a new process of the node: its old blocks are gone
            f.epoch, f.next_seq, f.resync_asked_at = epoch, 0, None
            self.index.clear_node(name)
        if fields[b"kind"] == b"snapshot":
            seq = int(data["seq"])
            if seq + 1 >= f.next_seq:  # not older than what we have
                self.index.replace_node(name, ((bytes.fromhex(b[0]), tier_bit(b[4])) for b in data["blocks"]))
                f.next_seq, f.resync_asked_at = seq + 1, None
                self.num_resyncs += 1
            return
        for seq, kind, h, _parent, _num_tokens, _group, tier in data["events"]:
            if f.resync_asked_at is not None or seq < f.next_seq:
                continue
            if seq > f.next_seq:
                self.num_gaps += 1
                logger.warning(
                    "KV events of %s: seq %d after %d (lost events); re-syncing", name, seq, f.next_seq - 1
                )
                await self._ask_resync(name, f)
                continue
            f.next_seq += 1
            self.num_events += 1
            if kind == "stored":
                self.index.add(name, bytes.fromhex(h), tier_bit(tier))
            elif kind == "removed":
                self.index.remove(name, bytes.fromhex(h), tier_bit(tier))
            else:
                self.index.clear_node(name)
        last_seq = int(data.get("last_seq", -1))
        if f.resync_asked_at is None and last_seq >= f.next_seq:  # lost at the tail
            self.num_gaps += 1
            logger.warning(
                "KV events of %s: seq %d sent, lost from %d on; re-syncing", name, last_seq, f.next_seq
            )
            await self._ask_resync(name, f)

    async def _ask_resync(self, name: str, f: _Follow) -> None:
        f.resync_asked_at = asyncio.get_running_loop().time()
        await self._r.rpush(resync_key(name), "1")  # type: ignore[misc]
        await self._r.expire(resync_key(name), RESYNC_KEY_TTL_S)  # a dead node's asks go away
