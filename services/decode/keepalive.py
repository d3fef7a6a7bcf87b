"""Decode keeps prefill's leases alive while its requests wait in the queue (docs/design.md §2).

Prefill holds a request's KV under a lease (``kv_lease_s``) that a pull extends. Under load a
request can wait on decode longer than the lease before its pull starts (128 streams: 133 of
~158 found their KV expired and were recomputed). So being queued on decode is a heartbeat too:
every ``kv_keepalive_s`` decode sends each prefill node one ``KeepAlive`` with the transfer_ids
still queued for it. The answer also carries the prefill's epoch: a new one means it restarted,
so the handshake is redone and the lost transfers fail fast on their pull.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from typing import TYPE_CHECKING

import grpc

from pdserve.engine.llm_engine import LLMEngine
from pdserve.kvtransfer.params import RemotePrefillParams
from pdserve.rpc import channel
from pdserve.rpc import node_pb2 as pb

if TYPE_CHECKING:
    from services.decode.server import DecodeNode

logger = logging.getLogger(__name__)


def queued_transfers(engine: LLMEngine) -> dict[str, list[str]]:
    """Engine thread: prefill address -> transfer_ids of requests queued here before their pull.

    A pull in flight needs no keep-alive (prefill's tracker never expires a hold it is sending
    from), and asking for it races with its release ("unknown" right after a good pull)."""
    sched = engine.scheduler
    out: dict[str, list[str]] = defaultdict(list)
    for req in [*sched.waiting, *sched.waiting_for_grammar.values()]:  # a grammar compiling: queued too
        p = req.kv_transfer_params
        # No first token yet: a leg opened with its prefill leg, whose prefill may not hold the
        # KV yet (nothing to keep alive; its pull waits for the hold).
        if isinstance(p, RemotePrefillParams) and req.output_token_ids:
            out[p.prefill_address].append(p.transfer_id)
    return dict(out)


class LeaseKeeper:
    def __init__(self, node: DecodeNode, interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"kv_keepalive_s must be > 0, got {interval_s}")
        self.node = node
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self.sent_total = 0  # transfer_ids kept alive
        self.unknown_total = 0  # transfer_ids prefill no longer held
        self.failures_total = 0  # KeepAlive calls that failed

    def ensure_started(self) -> None:
        """Started by the first disaggregated request (no change to the node's serve())."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kv-keepalive")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            el = self.node.engine_loop
            if el is None or not el.alive:
                return
            by_addr = await el.call(queued_transfers)
            await asyncio.gather(*(self.keep_alive(a, tids) for a, tids in by_addr.items()))

    async def keep_alive(self, address: str, transfer_ids: list[str]) -> list[str]:
        """One KeepAlive to one prefill node; returns the ids it no longer holds."""
        try:
            resp = await self.node._stub(address).KeepAlive(
                pb.KeepAliveRequest(transfer_ids=transfer_ids),
                timeout=self.interval_s,
                metadata=channel.auth_metadata(self.node.opts.shared_token),
            )
        except grpc.aio.AioRpcError as e:
            self.failures_total += 1
            logger.warning("KeepAlive to prefill %s failed: %s %s", address, e.code().name, e.details())
            return []
        self.sent_total += len(transfer_ids)
        known = self.node._peers.get(address)
        if known is not None and resp.epoch and resp.epoch != known.epoch:
            logger.warning(
                "prefill %s restarted (epoch %s -> %s): re-handshake", address, known.epoch, resp.epoch
            )
            self.node._peers.pop(address, None)
        unknown = list(resp.unknown_transfer_ids)
        if unknown:
            self.unknown_total += len(unknown)
            logger.warning(
                "prefill %s no longer holds %d queued transfer(s): %s", address, len(unknown), unknown[:5]
            )
        return unknown
