"""Decode keeps prefill's leases alive while its requests wait in the queue (docs/design.md §2).

Prefill holds a request's KV under a lease (``kv_lease_s``) that a pull extends. Under load a
request can wait on decode longer than the lease before its pull starts (128 streams: 133 of
~158 found their KV expired and were recomputed). So being queued on decode is a heartbeat too:
every ``kv_keepalive_s`` decode sends each prefill node one ``KeepAlive`` with the transfer_ids
still waiting for their pull (``PullTable.queued_by_peer``). The answer also carries the prefill's
epoch: a new one means it restarted, so the handshake is redone; the transfers it no longer
holds become EXPIRED and their pulls fail at once instead of asking.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from pdserve.kvtransfer.peer import PeerCallError, PrefillPeer
from pdserve.kvtransfer.pull_record import PullRecord, PullTable, TransferState

logger = logging.getLogger(__name__)


class LeaseKeeper:
    """One task on the event loop while records wait; started by ``ensure_started``."""

    def __init__(
        self,
        peers: PrefillPeer,
        records: PullTable,
        interval_s: float,
        on_epoch: Callable[[str, str], None],
    ) -> None:
        """``on_epoch(address, epoch)``: a KeepAlive answer's epoch (the consumer re-handshakes
        when it changed)."""
        if interval_s <= 0:
            raise ValueError(f"kv_keepalive_s must be > 0, got {interval_s}")
        self.peers = peers
        self.records = records
        self.interval_s = interval_s
        self._on_epoch = on_epoch
        self._task: asyncio.Task[None] | None = None
        self.sent_total = 0  # transfer_ids kept alive
        self.unknown_total = 0  # transfer_ids prefill no longer held
        self.failures_total = 0  # KeepAlive calls that failed

    def ensure_started(self) -> None:
        """The first queued record starts the task; it ends once no record is left."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kv-keepalive")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while len(self.records):
            await asyncio.sleep(self.interval_s)
            by_addr = self.records.queued_by_peer()
            await asyncio.gather(*(self.keep_alive(a, recs) for a, recs in by_addr.items()))

    async def keep_alive(self, address: str, records: list[PullRecord]) -> list[str]:
        """One KeepAlive to one prefill node; returns the ids it no longer holds (now EXPIRED)."""
        tids = [r.transfer_id for r in records]
        try:
            reply = await self.peers.keep_alive(address, tids, self.interval_s)
        except PeerCallError as e:
            self.failures_total += 1
            logger.warning("KeepAlive to prefill %s failed: %s %s", address, e.code, e.details)
            return []
        self.sent_total += len(tids)
        if reply.epoch:
            self._on_epoch(address, reply.epoch)
        unknown = list(reply.unknown_transfer_ids)
        if unknown:
            self.unknown_total += len(unknown)
            logger.warning(
                "prefill %s no longer holds %d queued transfer(s): %s", address, len(unknown), unknown[:5]
            )
            gone = set(unknown)
            for r in records:
                # still queued: its pull has not asked yet, so prefill's answer is the KV's fate
                if r.transfer_id in gone and r.state is TransferState.WAITING:
                    r.move(TransferState.EXPIRED)
        return unknown
