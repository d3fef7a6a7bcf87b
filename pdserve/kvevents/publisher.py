"""A node's KV event publisher: the BlockPool's listener, batched to Redis off the engine thread.

The engine thread only appends to a bounded list (under a lock held for a dict update and an
append); a publisher thread sends what gathered every ``flush_interval_s`` as one stream entry.
A full list drops the event (counted in ``num_dropped``); its seq is still used, so a consumer
sees the gap and re-syncs from a snapshot. The snapshot is the publisher's mirror of the cached
hashes (hash -> parent), kept with each event under the same lock, so it is exactly the cache after
the last seq it names.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis
from redis.exceptions import RedisError

from pdserve.config.kv_events_settings import KVEventsSettings
from pdserve.engine.block_pool import BlockPool

if TYPE_CHECKING:
    from pdserve.kvoffload.manager import KVOffloadManager
from pdserve.kvevents import TIER_DEVICE, resync_key, stream_key

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PublisherConfig:
    flush_interval_s: float = 0.02  # how often gathered events go out (one stream entry)
    max_pending_events: int = 65536  # events waiting for the publisher thread; more are dropped
    max_events_per_entry: int = 4096  # a longer batch becomes several stream entries
    stream_maxlen: int = 10000  # stream entries kept per node (approximate trim)
    redis_timeout_s: float = 1.0  # one Redis operation (connect, send, answer)
    resync_poll_s: float = 1.0  # how long one wait for a re-sync request blocks


class KVEventPublisher:
    """Listener on a BlockPool (``block_stored`` / ``block_removed`` on the engine thread) and the
    threads that publish. ``start`` clears the stream and publishes all_cleared at seq 0."""

    def __init__(
        self, redis_url: str, node: str, epoch: str, block_size: int, cfg: PublisherConfig, group: int = 0
    ) -> None:
        self.node, self.epoch, self.block_size, self.cfg = node, epoch, block_size, cfg
        # The KV cache group whose block table the events describe. The engine keeps one block
        # table that every group reads (engine/kv_cache_groups.py), so a node has one: group 0.
        self.group = group
        self._r = redis.Redis.from_url(
            redis_url, socket_timeout=cfg.redis_timeout_s, socket_connect_timeout=cfg.redis_timeout_s
        )
        # BLPOP waits up to resync_poll_s: its socket must wait longer than that.
        self._ctl = redis.Redis.from_url(
            redis_url,
            socket_timeout=cfg.resync_poll_s + cfg.redis_timeout_s,
            socket_connect_timeout=cfg.redis_timeout_s,
        )
        self._lock = threading.Lock()
        self._mirror: dict[tuple[bytes, str], bytes | None] = {}  # (hash, tier) -> parent
        self._pending: list[list[object]] = []
        self._seq = -1
        self._announced_seq = -1  # the last_seq of the last entry sent (publisher thread)
        self._resync = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._reachable = True
        self.num_dropped = 0  # events never sent (queue full or Redis failed)
        self.num_published = 0
        self.num_snapshots = 0

    # -- the listener (engine thread) -----------------------------------------------------------
    def block_stored(self, block_hash: bytes, parent_hash: bytes | None) -> None:
        self.tier_stored(block_hash, parent_hash, TIER_DEVICE)

    def block_removed(self, block_hash: bytes) -> None:
        self.tier_removed(block_hash, TIER_DEVICE)

    def tier_stored(self, block_hash: bytes, parent_hash: bytes | None, tier: str) -> None:
        """A block cached in ``tier`` (device, or the offload tier's cpu / disk)."""
        with self._lock:
            self._mirror[(block_hash, tier)] = parent_hash
            self._emit("stored", block_hash, parent_hash, tier)

    def tier_removed(self, block_hash: bytes, tier: str) -> None:
        with self._lock:
            self._mirror.pop((block_hash, tier), None)
            self._emit("removed", block_hash, None, tier)

    def all_cleared(self) -> None:
        with self._lock:
            self._mirror.clear()
            self._emit("all_cleared", None, None, TIER_DEVICE)

    def _emit(self, kind: str, h: bytes | None, parent: bytes | None, tier: str) -> None:
        self._seq += 1
        if len(self._pending) >= self.cfg.max_pending_events:
            self.num_dropped += 1
            return
        n = self.block_size if kind == "stored" else 0
        self._pending.append(
            [self._seq, kind, h.hex() if h else "", parent.hex() if parent else "", n, self.group, tier]
        )

    # -- life ------------------------------------------------------------------------------------
    def start(self) -> None:
        try:
            self._r.delete(stream_key(self.node), resync_key(self.node))
        except RedisError as e:
            self._set_reachable(False, e)
        self.all_cleared()
        for target, name in ((self._run_publish, "kvevents-publish"), (self._run_resync, "kvevents-resync")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Send what is pending, stop both threads (each within ``timeout_s``), close connections."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)
        self._r.close()
        self._ctl.close()

    def request_resync(self) -> None:
        """A snapshot goes out with the next flush (what a consumer's resync request does)."""
        self._resync.set()

    # -- publisher thread --------------------------------------------------------------------------
    def _run_publish(self) -> None:
        while not self._stop.wait(self.cfg.flush_interval_s):
            self.flush()
        self.flush()

    def flush(self) -> None:
        """One round: a snapshot if one was asked for, then every pending event (publisher thread)."""
        if self._resync.is_set():
            self._resync.clear()
            with self._lock:
                seq = self._seq
                blocks = [
                    [h.hex(), p.hex() if p else "", self.block_size, self.group, tier]
                    for (h, tier), p in self._mirror.items()
                ]
            if self._xadd("snapshot", {"seq": seq, "blocks": blocks}):
                self.num_snapshots += 1
        with self._lock:
            batch, self._pending, last_seq = self._pending, [], self._seq
        if not batch and last_seq == self._announced_seq:
            return
        # Every entry names the last seq assigned: events dropped at the tail (nothing after them
        # yet) are a gap the consumer sees now, not at the next event.
        step = self.cfg.max_events_per_entry
        for i in range(0, max(len(batch), 1), step):
            part = batch[i : i + step]
            if self._xadd("batch", {"events": part, "last_seq": last_seq}):
                self.num_published += len(part)
            else:
                self.num_dropped += len(part)
        self._announced_seq = last_seq

    def _xadd(self, kind: str, data: dict[str, object]) -> bool:
        fields: dict[str, str] = {"epoch": self.epoch, "kind": kind, "data": json.dumps(data)}
        try:
            self._r.xadd(stream_key(self.node), fields, maxlen=self.cfg.stream_maxlen, approximate=True)  # type: ignore[arg-type]
        except RedisError as e:
            self._set_reachable(False, e)
            return False
        self._set_reachable(True, None)
        return True

    # -- re-sync requests --------------------------------------------------------------------------
    def _run_resync(self) -> None:
        while not self._stop.is_set():
            try:
                got = self._ctl.blpop([resync_key(self.node)], timeout=self.cfg.resync_poll_s)
                if got is not None:
                    self._ctl.delete(resync_key(self.node))  # several asks, one snapshot
            except RedisError as e:
                self._set_reachable(False, e)
                self._stop.wait(self.cfg.resync_poll_s)
                continue
            if got is not None:
                self.request_resync()

    def _set_reachable(self, ok: bool, err: Exception | None) -> None:
        # Transitions only: an outage must not log once per flush.
        if ok and not self._reachable:
            logger.info("KV events of %s: Redis reachable again (a consumer re-syncs on the gap)", self.node)
        elif not ok and self._reachable:
            logger.warning(
                "KV events of %s: Redis unreachable, events dropped until it returns: %s", self.node, err
            )
        self._reachable = ok


def start_publisher(
    pool: BlockPool,
    redis_url: str,
    node: str,
    epoch: str,
    block_size: int,
    settings: KVEventsSettings,
    offload: KVOffloadManager | None = None,
) -> KVEventPublisher:
    """Publish ``pool``'s prefix-cache changes from now on (all_cleared first: a fresh cache)."""
    cfg = PublisherConfig(
        flush_interval_s=settings.flush_interval_s,
        max_pending_events=settings.max_pending_events,
        max_events_per_entry=settings.max_events_per_entry,
        stream_maxlen=settings.stream_maxlen,
        redis_timeout_s=settings.redis_timeout_s,
    )
    pub = KVEventPublisher(redis_url, node, epoch, block_size, cfg)
    pub.start()
    pool.listener = pub
    if offload is not None:  # blocks stored in / removed from the offload tier: tier cpu / disk
        offload.set_listener(pub)
    return pub
