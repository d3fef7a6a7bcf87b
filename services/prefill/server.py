"""The prefill node: prompt -> first token, KV held under a lease, pushed into decode's blocks."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import grpc

from pdserve import tracing
from pdserve.config.node_spec import NodeSpec
from pdserve.distributed.pp_stage import KVWorkers, StageWriteBackend
from pdserve.engine.request import Request
from pdserve.errors import CapacityError, ConfigError, InvalidRequestError, PdserveError
from pdserve.kvtransfer.backend import TransferBackend
from pdserve.kvtransfer.checksum import kv_blocks_digest
from pdserve.kvtransfer.connector import KVProducer
from pdserve.kvtransfer.handshake import HandshakeError, check_compat
from pdserve.kvtransfer.head_slices import GatherWriter, HeadLayout
from pdserve.kvtransfer.params import RemoteDecodeParams
from pdserve.kvtransfer.producer_group import KVProducerGroup, PullRefusal, PullRefusedError
from pdserve.kvtransfer.staging import Stager
from pdserve.kvtransfer.topology import kv_head_range
from pdserve.kvtransfer.transfer_table import DuplicateTransferError
from pdserve.rpc import channel, convert, kv_convert
from pdserve.rpc import node_pb2 as pb
from pdserve.rpc import node_pb2_grpc as pb_grpc
from pdserve.rpc.mm_convert import items_from_pb, to_engine_items
from services.lora_rpc import LoRAServicer, check_request_lora
from services.mm_items import ColocatedEncoder, EmbeddingFetcher, EmbeddingUnavailableError
from services.node import NodeBase
from services.prefill.trace_spans import PrefillTraces

logger = logging.getLogger(__name__)
EXPIRE_EVERY_S = 0.5
_REFUSAL_STATUS = {
    PullRefusal.STALE: grpc.StatusCode.FAILED_PRECONDITION,
    PullRefusal.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    PullRefusal.NOT_READY: grpc.StatusCode.DEADLINE_EXCEEDED,
    PullRefusal.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    PullRefusal.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
}


class PrefillNode(NodeBase):
    def __init__(self, opts: NodeSpec) -> None:
        super().__init__(opts)
        assert isinstance(self.backend, TransferBackend)
        bs, n = self.engine.kv.block_size, len(self.stages)
        # One producer per stage / TP rank, one tracker for the node (one block table): a request
        # is freed once every producer counted its consumers. Stage 0 / rank 0 writes here; the
        # others in their process.
        h = self.handshake
        cache = self.engine.runner.kv_cache
        assert cache is not None
        layout = HeadLayout(bs, h.head_dim, cache.element_size())
        runner = self.engine.runner
        self.producers: list[KVProducer] = []
        kv = self.engine.kv  # KV groups with block tables of their own: each moves with its ids
        groups = [set(m.spec.layer_names) for m in kv.coordinator.managers] if kv.groups is not None else []
        self.stager = Stager(self.backend, cache)  # rank 0's head gathers (kvtransfer/staging.py)
        for i, st in enumerate(self.stages):
            backend: TransferBackend = self.backend
            gatherer: GatherWriter = self.stager
            if i:
                assert isinstance(runner, KVWorkers)
                backend = gatherer = StageWriteBackend(runner, st)
            self.producers.append(
                KVProducer(
                    backend,
                    st.regions,
                    bs,
                    self._release,
                    lease_s=opts.kv_lease_s,
                    stage=i,
                    num_stages=n,
                    tracker=self.producers[0].tracker if i else None,
                    heads=kv_head_range(st.tp_rank, st.tp_size, h.num_kv_heads),
                    layout=layout,
                    gatherer=gatherer,
                    layer_groups=groups,
                )
            )
        self.producer = self.producers[0]
        self._last_expire = 0.0
        self.traces = PrefillTraces()  # spans of Prefill calls (only with tracing on)
        self.pushes = KVProducerGroup(
            self.producers,
            self.handshake,
            opts.kv_ready_timeout_s,
            self._blocks_digest,
            push_delay_s=opts.faults.push_delay_s,  # test-only: a long transfer window (bench/chaos.py)
            ranks=[(st.pp_rank, st.tp_rank) for st in self.stages],
        )
        self.leases_expired_total = 0  # holds freed by their lease, not by their consumers' pulls
        self.fetcher: EmbeddingFetcher | None = None
        self.colocated: ColocatedEncoder | None = None
        if opts.colocated_encoder:
            from pdserve.models.image_processor import ImageLimits

            self.colocated = ColocatedEncoder(
                opts.engine.model, opts.image_limits or ImageLimits(), opts.ec_buffer_bytes, self.registry
            )
        if opts.ec_consumer:
            from pdserve.embedcache.index import EmbeddingIndex

            if not opts.redis_url:
                raise ConfigError(f"node {opts.name}: an EC consumer needs redis_url (the embedding index)")
            self.fetcher = EmbeddingFetcher(
                self.backend,
                EmbeddingIndex.from_url(opts.redis_url),
                opts.ec_buffer_bytes,
                opts.ec_lease_s,
                opts.ec_fetch_timeout_s,
                opts.shared_token,
                self.registry,
            )

    async def mm_items_of(self, request: pb.PrefillRequest) -> list[Any]:
        """The request's image items with their tensors (fetched from encoders where missing)."""
        items = items_from_pb(request.mm_items, self.opts.mm_policy)
        local: dict[str, Any] = {}
        if any(it.image is not None for it in items):
            if self.colocated is None:
                raise InvalidRequestError(
                    f"node {self.opts.name!r} does not encode images itself (an encoder node serves "
                    "this model): send cache keys",
                    field="mm_items",
                )
            assert self.engine_loop is not None
            local = await self.colocated.embeds_of(items, self.engine_loop)
        if any(it.embeds is None and it.image is None for it in items):
            assert self.fetcher is not None, "allow_missing_mm_embeds is derived only for EC consumers here"
            tensors = await self.fetcher.fetch_all(items)
        else:
            tensors = [it.embeds for it in items]
        tensors = [local[it.key] if it.image is not None else t for it, t in zip(items, tensors, strict=True)]
        return to_engine_items(items, tensors)

    def ec_reservations(self) -> int:
        return self.fetcher.num_reserved if self.fetcher is not None else 0

    def _on_hold(self, req: Request, block_ids: list[int]) -> bool:
        params = req.kv_transfer_params
        assert isinstance(params, RemoteDecodeParams), params
        try:
            self.producer.on_hold(
                params.transfer_id,
                block_ids,
                params.need_send,
                list(req.output_token_ids),
                self.engine.kv.group_block_ids_views(req.request_id),
            )
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
        if tracing.enabled() and self.engine_loop is not None:
            self.traces.after_step(engine, self.engine_loop.last_step_start_s)
        if now - self._last_expire >= EXPIRE_EVERY_S:
            self._last_expire = now
            expired = self.producer.tracker.expire()
            self.leases_expired_total += len(expired)
            if expired:
                logger.warning("KV lease expired for %d transfer(s): %s", len(expired), expired[:5])

    def _blocks_digest(self, block_ids: Sequence[int]) -> str:
        """Worker thread (a pull asked for a checksum): the digest of held blocks."""
        return kv_blocks_digest(self.engine.runner.kv_cache, list(block_ids)).hex()

    def aborted_holds_total(self) -> int:
        return self.producer.aborted_total

    def held_transfer_blocks(self) -> int:
        return self.producer.tracker.num_held_blocks

    def stranded_kv_blocks(self) -> int:
        return self.producer.tracker.stranded_blocks()

    def request_state_sizes(self) -> dict[str, int]:
        return {
            **super().request_state_sizes(),
            "kv_producer.transfers": sum(p.num_transfers for p in self.producers),
            "kv_send_tracker.entries": len(self.producer.tracker),
        }

    def transfer_counters(self) -> list[tuple[str, str, float]]:
        ps = self.producers
        return [
            ("kv_transfer_bytes", "KV bytes pushed to decode nodes", sum(p.bytes_total for p in ps)),
            ("kv_transfer_seconds", "Seconds spent in KV pushes", sum(p.seconds_total for p in ps)),
            ("kv_transfer_failures", "KV pushes that failed", sum(p.failures_total for p in ps)),
            ("kv_transfers", "KV pushes attempted (one per stage asked)", sum(p.pushes_total for p in ps)),
            ("kv_leases_expired", "KV holds freed by lease expiry", self.leases_expired_total),
        ]

    def stage_transfer_counters(self, index: int) -> tuple[int, int, int]:
        p = self.producers[index]
        return (p.bytes_total, p.failures_total, p.pushes_total)

    def add_servicers(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(self), server)


class PrefillServicer(LoRAServicer, pb_grpc.PrefillServiceServicer):
    node: PrefillNode

    def __init__(self, node: PrefillNode) -> None:
        self.node = node

    async def Prefill(
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> pb.PrefillResponse:
        node = self.node
        tid = request.transfer_id
        t_call = time.monotonic()
        if tracing.enabled():
            node.traces.begin(tid, t_call)
        # Its end, whatever ends the call: refused before admission (an early pull waiting for it
        # fails now), or cancelled by its caller (a hold nobody will pull is released now).
        transfer = node.producer.track(tid)
        context.add_done_callback(lambda ctx: transfer.close(ctx.cancelled()))
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
        mm_items: list[Any] = []
        if request.mm_items:
            try:
                mm_items = await node.mm_items_of(request)
            except InvalidRequestError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except CapacityError as e:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            except EmbeddingUnavailableError as e:
                # Not this node's fault (no breaker move, no retry elsewhere): the router answers 503.
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        lora_ident = await check_request_lora(
            node.engine_loop, request.lora_name, request.lora_ident, context
        )
        try:
            transfer.admit()
        except DuplicateTransferError as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        assert node.engine_loop is not None
        first = None
        try:
            async for d in node.engine_loop.generate(
                list(request.prompt_token_ids),
                first_params,
                tid,
                kv_transfer_params=kv_params,
                prompt_embeds=embeds,
                mm_items=mm_items,
                lora_name=request.lora_name,
            ):
                first = d
        except PdserveError as e:
            transfer.fail()
            await context.abort(channel.error_to_status(e), str(e))
        except asyncio.CancelledError:
            # The router went away: generate() aborted the request; if it had already finished,
            # its KV is held for nobody - release it now, not at the lease's end.
            transfer.cancel()
            raise
        assert first is not None
        if node.opts.faults.prefill_reply_delay_s:  # test-only: a slow prefill (bench/chaos.py)
            await asyncio.sleep(node.opts.faults.prefill_reply_delay_s)
        if first.finish_reason == "error" and first.overloaded:
            # Queue limit / queue wait (max_queue_*): nothing was computed or held; a 503 upstream.
            transfer.fail()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, first.error or "prefill node is full")
        if first.finish_reason == "error":
            # A node fault (engine step failed, engine thread died), not the request's: a status
            # the router retries on another prefill node, instead of a "first token" that is an error.
            transfer.fail()
            alive = node.engine_loop.alive
            await context.abort(
                grpc.StatusCode.INTERNAL if alive else grpc.StatusCode.UNAVAILABLE,
                first.error or "prefill failed",
            )
        if first.finish_reason == "length" and (params.max_tokens is None or params.max_tokens > 1):
            first.finish_reason = None  # length of the prefill leg only: decode continues
        held = transfer.finish()
        if tracing.enabled():
            node.traces.end(
                tid,
                tracing.context_of(tracing.metadata_traceparent(context.invocation_metadata())),
                {
                    "pdserve.node": node.opts.name,
                    "pdserve.prompt_tokens": len(request.prompt_token_ids),
                    "pdserve.cached_tokens": first.num_cached_tokens,
                    "pdserve.kv_held": held,
                },
                held,
            )
        return pb.PrefillResponse(
            first=convert.delta_to_pb(first),
            kv_held=held,
            epoch=node.epoch,
            lora_ident=lora_ident,
        )

    async def PushKV(self, request: pb.PushKVRequest, context: grpc.aio.ServicerContext) -> pb.PushKVResponse:
        node = self.node
        try:
            pull = kv_convert.pull_request_from_pb(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            out = await node.pushes.serve(pull)
        except PullRefusedError as e:
            await context.abort(_REFUSAL_STATUS[e.refusal], str(e))
        if tracing.enabled() and out.ok:
            node.traces.pulled(
                pull.transfer_id, sum(r.bytes for r in out.results), max(r.seconds for r in out.results)
            )
        return kv_convert.push_outcome_to_pb(out, [node.stage_info(pb, node.stages[i]) for i in out.stages])

    async def Handshake(
        self, request: pb.HandshakeRequest, context: grpc.aio.ServicerContext
    ) -> pb.HandshakeResponse:
        try:
            remote = kv_convert.handshake_from_pb(request.info)
            check_compat(self.node.handshake, remote)
        except HandshakeError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        node = self.node
        stages = [node.stage_info(pb, st) for st in node.stages]
        return pb.HandshakeResponse(info=kv_convert.handshake_to_pb(node.handshake, stages))

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
        report = await self.node.answer_load(pb, context)
        report.num_pushes_in_flight = self.node.pushes.pushes_in_flight
        return report
