"""The prefill node: prompt -> first token, KV held under a lease, pushed into decode's blocks."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

import grpc

from pdserve.engine.request import Request
from pdserve.errors import InvalidRequestError, PdserveError
from pdserve.kvtransfer.backend import TransferBackend
from pdserve.kvtransfer.checksum import kv_blocks_digest
from pdserve.kvtransfer.connector import DuplicateTransferError, KVProducer
from pdserve.kvtransfer.handshake import HandshakeError, HandshakeInfo, check_compat
from pdserve.kvtransfer.params import RemoteDecodeParams
from pdserve.kvtransfer.regions import BlockIdError, Region, RegionMismatchError
from pdserve.kvtransfer.send_tracker import UnknownTransferError
from pdserve.rpc import channel, convert
from pdserve.rpc import node_pb2 as pb
from pdserve.rpc import node_pb2_grpc as pb_grpc
from services.node import NodeBase, NodeOptions

logger = logging.getLogger(__name__)
EXPIRE_EVERY_S = 0.5


def handshake_to_pb(h: HandshakeInfo) -> pb.HandshakeInfo:
    return pb.HandshakeInfo(**h.to_dict())


def handshake_from_pb(m: pb.HandshakeInfo) -> HandshakeInfo:
    return HandshakeInfo.from_dict(
        {
            "model_id": m.model_id,
            "dtype": m.dtype,
            "block_size": m.block_size,
            "layer_names": list(m.layer_names),
            "num_kv_heads": m.num_kv_heads,
            "head_dim": m.head_dim,
            "layout_version": m.layout_version,
            "epoch": m.epoch,
            "compat_hash": m.compat_hash,
        }
    )


class PrefillNode(NodeBase):
    def __init__(self, opts: NodeOptions) -> None:
        super().__init__(opts)
        assert isinstance(self.backend, TransferBackend)
        self.producer = KVProducer(
            self.backend, self.regions, self.engine.kv.block_size, self._release, lease_s=opts.kv_lease_s
        )
        self._last_expire = 0.0

    def _on_hold(self, req: Request, block_ids: list[int]) -> bool:
        params = req.kv_transfer_params
        assert isinstance(params, RemoteDecodeParams), params
        try:
            self.producer.on_hold(params.transfer_id, block_ids, params.need_send)
        except ValueError as e:  # already held (admission refuses this): free, never kill the step
            logger.error("not holding KV of %s: %s", req.request_id, e)
            return False
        return True

    def _release(self, transfer_id: str) -> None:
        # Tracker callback (any thread): the engine thread frees the blocks.
        assert self.engine_loop is not None
        self.engine_loop.post(lambda e: e.scheduler.release_held(transfer_id))

    def _on_step(self, engine: Any) -> None:
        now = time.monotonic()
        if now - self._last_expire >= EXPIRE_EVERY_S:
            self._last_expire = now
            expired = self.producer.tracker.expire()
            if expired:
                logger.warning("KV lease expired for %d transfer(s): %s", len(expired), expired[:5])

    def release_if_cancelled(self, context: Any, transfer_id: str) -> None:
        """A Prefill RPC ended: if its caller cancelled it (even after our answer was ready, which
        no exception tells the handler), nobody will pull this KV - release the hold now."""
        if context.cancelled():
            self.producer.abort(transfer_id)
            self.producer.forget(transfer_id)

    def push_digest(self, transfer_id: str, num_tokens: int) -> str:
        """Digest of the held blocks a push of ``num_tokens`` sends (taken before the push: after
        it the blocks may be freed and reused)."""
        entry = self.producer.tracker.get(transfer_id)
        if entry is None:
            return ""  # the push below answers NOT_FOUND
        n = -(-num_tokens // self.engine.kv.block_size)
        return kv_blocks_digest(self.engine.runner.kv_cache, entry.block_ids[:n]).hex()

    def aborted_holds_total(self) -> int:
        return self.producer.aborted_total

    def held_transfer_blocks(self) -> int:
        return self.producer.tracker.num_held_blocks

    def stranded_kv_blocks(self) -> int:
        return self.producer.tracker.stranded_blocks()

    def transfer_counters(self) -> list[tuple[str, str, float]]:
        p = self.producer
        return [
            ("kv_transfer_bytes", "KV bytes pushed to decode nodes", p.bytes_total),
            ("kv_transfer_seconds", "Seconds spent in KV pushes", p.seconds_total),
            ("kv_transfer_failures", "KV pushes that failed", p.failures_total),
            ("kv_transfers", "KV pushes attempted", p.pushes_total),
        ]

    def add_servicers(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(self), server)


class PrefillServicer(pb_grpc.PrefillServiceServicer):
    def __init__(self, node: PrefillNode) -> None:
        self.node = node

    async def Prefill(
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> pb.PrefillResponse:
        node = self.node
        tid = request.transfer_id
        if not tid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "transfer_id is required")
        try:
            params = convert.sampling_from_pb(request.sampling)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        # Prefill samples the first token only; decode continues with the client's params.
        first_params = dataclasses.replace(
            params, max_tokens=1, min_tokens=min(params.min_tokens, 1), stop=list(params.stop)
        )
        kv_params = RemoteDecodeParams(
            tid, max(1, request.need_send), final_at_prefill=params.max_tokens == 1
        )
        embeds = None
        if request.HasField("prompt_embeds"):
            try:
                embeds = convert.tensor_from_pb(request.prompt_embeds)
            except InvalidRequestError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"prompt_embeds: {e}")
        try:
            node.producer.admit(tid)
        except DuplicateTransferError as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        context.add_done_callback(lambda ctx: node.release_if_cancelled(ctx, tid))
        assert node.engine_loop is not None
        first = None
        try:
            async for d in node.engine_loop.generate(
                list(request.prompt_token_ids),
                first_params,
                tid,
                kv_transfer_params=kv_params,
                prompt_embeds=embeds,
            ):
                first = d
        except PdserveError as e:
            node.producer.forget(tid)
            await context.abort(channel.error_to_status(e), str(e))
        except asyncio.CancelledError:
            # The router went away: generate() aborted the request; if it had already finished,
            # its KV is held for nobody - release it now, not at the lease's end.
            node.producer.abort(tid)
            node.producer.forget(tid)
            raise
        assert first is not None
        if first.finish_reason == "error" and first.overloaded:
            # Queue limit / queue wait (max_queue_*): nothing was computed or held; a 503 upstream.
            node.producer.forget(tid)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, first.error or "prefill node is full")
        if first.finish_reason == "error":
            # A node fault (engine step failed, engine thread died), not the request's: a status
            # the router retries on another prefill node, instead of a "first token" that is an error.
            node.producer.forget(tid)
            alive = node.engine_loop.alive
            await context.abort(
                grpc.StatusCode.INTERNAL if alive else grpc.StatusCode.UNAVAILABLE,
                first.error or "prefill failed",
            )
        if first.finish_reason == "length" and (params.max_tokens is None or params.max_tokens > 1):
            first.finish_reason = None  # length of the prefill leg only: decode continues
        held = tid in node.producer.tracker
        if not held:
            node.producer.forget(tid)
        return pb.PrefillResponse(first=convert.delta_to_pb(first), kv_held=held, epoch=node.epoch)

    async def PushKV(self, request: pb.PushKVRequest, context: grpc.aio.ServicerContext) -> pb.PushKVResponse:
        node = self.node
        tid = request.transfer_id
        if request.expected_src_epoch and request.expected_src_epoch != node.epoch:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"prefill restarted: epoch is {node.epoch}, decode expected {request.expected_src_epoch}",
            )
        if request.dst_compat_hash != node.handshake.compat_hash:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "KV layout mismatch (compat hash differs): run Handshake to see which field",
            )
        try:
            ready = await asyncio.to_thread(node.producer.wait_ready, tid, node.opts.kv_ready_timeout_s)
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown transfer_id {tid!r}")
        if not ready:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"KV for {tid!r} not ready in time")
        digest = ""
        if request.want_checksum:
            digest = await asyncio.to_thread(node.push_digest, tid, request.num_tokens)
        try:
            regions = [
                Region(
                    r.layer_name,
                    r.occurrence,
                    r.base_addr,
                    r.block_stride_bytes,
                    r.block_bytes,
                    r.num_blocks or None,
                )
                for r in request.dst_regions
            ]
            res = await asyncio.to_thread(
                node.producer.push,
                tid,
                list(request.dst_block_ids),
                request.num_tokens,
                regions,
                request.dst_session,
                # the asking decode stage: a retried pull from it is counted once
                (request.dst_pp_rank, request.dst_tp_rank),
            )
        except UnknownTransferError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except (RegionMismatchError, BlockIdError, InvalidRequestError, ValueError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if not res.ok:
            logger.warning("push %s failed: %s", tid, res.error)
        return pb.PushKVResponse(
            ok=[tid] if res.ok else [],
            failed=[] if res.ok else [tid],
            bytes=res.bytes,
            num_descriptors=res.num_descriptors,
            seconds=res.seconds,
            checksum=digest,
        )

    async def Handshake(
        self, request: pb.HandshakeRequest, context: grpc.aio.ServicerContext
    ) -> pb.HandshakeResponse:
        try:
            remote = handshake_from_pb(request.info)
            check_compat(self.node.handshake, remote)
        except HandshakeError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return pb.HandshakeResponse(info=handshake_to_pb(self.node.handshake))

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        node = self.node
        n = 0
        ids = set(request.transfer_ids) | set(request.request_ids)
        assert node.engine_loop is not None
        # Engine first: a request finishing meanwhile is then held already, and freed just below.
        aborted = await node.engine_loop.call(lambda e: e.abort(list(ids)))
        for tid in ids:
            if node.producer.abort(tid):
                n += 1
        return pb.AbortResponse(num_aborted=n + len(aborted))

    async def KeepAlive(
        self, request: pb.KeepAliveRequest, context: grpc.aio.ServicerContext
    ) -> pb.KeepAliveResponse:
        unknown = self.node.producer.keep_alive(list(request.transfer_ids))
        return pb.KeepAliveResponse(unknown_transfer_ids=unknown, epoch=self.node.epoch)

    async def GetLoad(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadReport:
        return await self.node.answer_load(pb, context)
