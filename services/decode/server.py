"""The decode node: receives KV from prefill, generates the rest, streams tokens.

Also serves colocated requests (``remote_prefill`` false): prefill runs here, nothing moves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from prometheus_client import Histogram

from pdserve import tracing
from pdserve.config.choices import KvLoadFailurePolicy
from pdserve.config.node_spec import NodeSpec
from pdserve.engine.outputs import GenerationDelta
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import PdserveError
from pdserve.kvtransfer.checksum import kv_blocks_digest
from pdserve.kvtransfer.consumer import KVConsumer
from pdserve.kvtransfer.handshake import HandshakeError
from pdserve.kvtransfer.load_policy import KV_LOAD_FAILED_KEY
from pdserve.kvtransfer.params import KVLoadSpec, RemotePrefillParams
from pdserve.kvtransfer.peer import PeerCallError
from pdserve.rpc import channel, convert
from pdserve.rpc import node_pb2 as pb
from pdserve.rpc import node_pb2_grpc as pb_grpc
from pdserve.rpc.mm_convert import items_from_pb, to_engine_items
from pdserve.rpc.prefill_client import PrefillClient
from services.decode.outbox import Outbox
from services.decode.trace_spans import trace_decode
from services.lora_rpc import LoRAServicer, request_lora_refusal
from services.node import NodeBase
from services.steps_direct import DirectSteps

logger = logging.getLogger(__name__)
# 1 ms .. 60 s: a pull on one host over TCP takes milliseconds, one queued behind many seconds.
KV_PULL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60)


class DecodeNode(NodeBase):
    def __init__(self, opts: NodeSpec) -> None:
        super().__init__(opts)
        self.pull_times: dict[str, list[float]] = {}  # traces: a pull's start, end and bytes, by request
        self.kv_pull_seconds = Histogram(
            "pdserve:kv_pull_seconds",
            "Successful KV pulls: from the engine handing the pull over (its blocks allocated) to "
            "every stage's KV written (handshake and PushKV of all stages included).",
            ["node", "role"],
            buckets=KV_PULL_BUCKETS,
            registry=self.registry,
        ).labels(opts.name, opts.role)
        self.prefill_client = PrefillClient(opts.shared_token)
        self.kv_consumer = KVConsumer(
            self.prefill_client,
            self.handshake,
            self.stages,
            self.engine.kv.block_size,
            self._finish_kv_load,
            policy=opts.kv_load_failure_policy,
            pull_timeout_s=opts.kv_pull_timeout_s,
            keepalive_s=opts.kv_keepalive_s,
            checksum=self._local_digest if opts.kv_checksum else None,
            on_pull_seconds=self.kv_pull_seconds.observe,
        )

    def stage_transfer_counters(self, index: int) -> tuple[int, int, int]:
        c = self.kv_consumer
        return (c.stage_pull_bytes[index], c.stage_pull_failures[index], c.stage_pulls[index])

    def add_servicers(self, server: grpc.aio.Server) -> None:
        self.steps_servicer = DecodeServicer(self)
        pb_grpc.add_DecodeServiceServicer_to_server(self.steps_servicer, server)

    def request_state_sizes(self) -> dict[str, int]:
        return {**super().request_state_sizes(), **self.kv_consumer.request_state_sizes()}

    def transfer_counters(self) -> list[tuple[str, str, float]]:
        c, k = self.kv_consumer, self.kv_consumer.keeper
        return [
            ("kv_transfer_bytes", "KV bytes received from prefill nodes", c.pull_bytes_total),
            ("kv_transfer_seconds", "Seconds spent waiting for KV pushes", c.pull_seconds_total),
            ("kv_transfer_failures", "KV pulls that failed", c.pull_failures_total),
            (
                "kv_early_pulls",
                "KV pulls asked while the prompt was being prefilled (decode legs opened with their prefill leg)",
                c.early_pulls_total,
            ),
            ("kv_keepalive_transfers", "Queued transfers whose prefill lease decode extended", k.sent_total),
            ("kv_keepalive_unknown", "Queued transfers prefill no longer held", k.unknown_total),
            ("kv_keepalive_failures", "KeepAlive calls to prefill nodes that failed", k.failures_total),
            ("kv_checksums_verified", "Pulled transfers whose checksum matched", c.checksums_verified_total),
            (
                "kv_checksum_mismatches",
                "Pulled transfers whose checksum did not match",
                c.checksum_mismatches_total,
            ),
        ]

    def _local_digest(self, block_ids: Sequence[int]) -> str:
        """Worker thread (kv_checksum): the digest of blocks a pull wrote here."""
        return kv_blocks_digest(self.engine.runner.kv_cache, list(block_ids)).hex()

    # engine thread -> event loop: start the pulls a step asked for
    def _on_kv_loads(self, loads: list[KVLoadSpec]) -> None:
        assert self.loop is not None
        t = time.monotonic()  # the pulls' start, for kv_pull_seconds (the event loop may be busy)
        for spec in loads:
            if tracing.enabled():
                self.pull_times[spec.request_id] = [t]
            self.loop.call_soon_threadsafe(self.kv_consumer.start_pull, spec, t)

    def _finish_kv_load(
        self, request_id: str, ok: bool, policy: KvLoadFailurePolicy, error: str, first_tokens: Sequence[int]
    ) -> None:
        """Event loop: a pull ended; the engine runs the request or applies the policy."""
        assert self.engine_loop is not None
        if request_id in self.pull_times:
            rec = self.kv_consumer.records.get(request_id)
            self.pull_times[request_id] += [time.monotonic(), rec.num_bytes if rec is not None else 0]
        self.engine_loop.post_and_dispatch(
            lambda e: e.finish_kv_load(request_id, ok, policy, error, first_tokens)
        )


class DecodeServicer(LoRAServicer, pb_grpc.DecodeServiceServicer):
    node: DecodeNode

    def __init__(self, node: DecodeNode) -> None:
        self.node = node

    async def _open(self, request: pb.DecodeRequest) -> _Admission:
        """Check a DecodeRequest and, for remote prefill, handshake with its prefill node and open
        its KV record (last: a refusal leaves nothing behind): what to admit on the engine; a
        refusal raises ``_Refusal`` with the gRPC status."""
        node = self.node
        try:
            params = convert.sampling_from_pb(request.sampling)
        except PdserveError as e:
            raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
        if request.remote_prefill:
            if not request.transfer_id or not request.prefill_address:
                raise _Refusal(
                    grpc.StatusCode.INVALID_ARGUMENT, "remote_prefill needs transfer_id and prefill_address"
                )
            if bool(request.output_token_ids) == request.first_token_from_prefill:
                raise _Refusal(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "remote_prefill needs the first token (output_token_ids), or first_token_from_prefill "
                    "without it (the pull brings it)",
                )
        embeds = None
        if request.HasField("prompt_embeds"):
            try:
                embeds = convert.tensor_from_pb(request.prompt_embeds)
            except PdserveError as e:
                raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"prompt_embeds: {e}") from e
        mm_items: list[Any] = []
        no_recompute = False
        if request.mm_items:
            try:
                wire = items_from_pb(request.mm_items, node.opts.mm_policy)
                if not request.remote_prefill and any(it.embeds is None for it in wire):
                    raise PdserveError(
                        "decode prefills this prompt itself (no remote prefill), but its image items "
                        "carry no embeddings; send them to a prefill node (EC consumer) instead"
                    )
            except PdserveError as e:
                raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
            mm_items = to_engine_items(wire, [it.embeds for it in wire])
            # images' tensors not here: a failed pull cannot be recomputed on this node
            no_recompute = any(it.embeds is None for it in wire)
        assert node.engine_loop is not None
        why = request_lora_refusal(node.engine_loop.engine, request.lora_name, request.lora_ident)
        if why is not None:  # never continue KV under other adapter weights than it was made with
            raise _Refusal(grpc.StatusCode.FAILED_PRECONDITION, why)
        kv_params = None
        if request.remote_prefill:
            await self._open_transfer(request, no_recompute)
            kv_params = RemotePrefillParams(request.transfer_id, request.prefill_address)
        return _Admission(
            list(request.prompt_token_ids),
            params,
            request.request_id,
            dict(
                kv_transfer_params=kv_params,
                output_token_ids=list(request.output_token_ids) or None,
                prompt_embeds=embeds,
                mm_items=mm_items,
                lora_name=request.lora_name,
            ),
        )

    async def _open_transfer(self, request: pb.DecodeRequest, no_recompute: bool) -> None:
        """The request's KV record on the consumer (handshake with its prefill node first)."""
        addr = request.prefill_address
        try:
            await self.node.kv_consumer.open(
                request.request_id,
                request.transfer_id,
                addr,
                prefill_epoch=request.prefill_epoch,
                # opened with its prefill leg: the pull asks prefill to wait for the KV and brings
                # the first token; a failed one is the router's to re-drive, never recomputed here
                early=request.first_token_from_prefill,
                no_recompute=no_recompute,
            )
        except HandshakeError as e:
            raise _Refusal(grpc.StatusCode.FAILED_PRECONDITION, f"refused at handshake: {e}") from e
        except PeerCallError as e:
            raise _Refusal(
                grpc.StatusCode.FAILED_PRECONDITION if e.stale_peer else grpc.StatusCode.UNAVAILABLE,
                f"handshake with prefill {addr} failed: {e.details}",
            ) from e

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext) -> Any:
        node = self.node
        try:
            adm = await self._open(request)
        except _Refusal as r:
            node.kv_consumer.forget(request.request_id)
            await context.abort(r.code, r.details)
        except BaseException:
            node.kv_consumer.forget(request.request_id)
            raise
        assert node.engine_loop is not None
        gen = node.engine_loop.generate(adm.prompt_token_ids, adm.params, adm.request_id, **adm.kwargs)
        try:
            async for d in gen:
                if d.finish_reason == "error" and d.overloaded:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, d.error or "node is full")
                if d.finish_reason == "error" and node.kv_consumer.wants_reprefill(request.request_id):
                    context.set_trailing_metadata(((KV_LOAD_FAILED_KEY, "1"),))
                    await context.abort(
                        grpc.StatusCode.ABORTED, f"{d.error} (kv_load_failure_policy reprefill)"
                    )
                yield convert.delta_to_pb(d)
        except PdserveError as e:
            await context.abort(channel.error_to_status(e), str(e))
        finally:
            node.kv_consumer.forget(request.request_id)
            await gen.aclose()

    async def steps_session(
        self, request_iterator: AsyncIterator[pb.StepCommand], direct: DirectSteps
    ) -> AsyncIterator[pb.StepBatch]:
        """One Steps stream: one router connection to the Steps socket (services/steps_socket.py),
        every decode leg the router has on this node.

        The engine thread writes the requests' token deltas to the connection itself
        (``direct``, services/steps_direct.py). Each request runs as a task whose ends, refusals
        and error deltas go into the outbox; this yields the outbox as one batch whenever the
        previous write is done. The stream ending (the router went away) cancels every request's
        task, which aborts it on the engine."""
        outbox = Outbox()
        tasks: dict[str, asyncio.Task[None]] = {}

        def admit(r: pb.DecodeRequest) -> None:
            rid = r.request_id
            gate = self.node.drain_gate
            if gate is not None and gate.draining:
                outbox.end(rid, grpc.StatusCode.UNAVAILABLE, "node is draining: Decode refused, use another")
                return
            if not rid or rid in tasks:
                outbox.end(rid, grpc.StatusCode.INVALID_ARGUMENT, f"request id {rid!r} is empty or in use")
                return
            task = asyncio.get_running_loop().create_task(
                self._step_request(r, outbox, direct), name=f"step-{rid}"
            )
            tasks[rid] = task

            def done(_t: asyncio.Task[None], rid: str = rid) -> None:
                tasks.pop(rid, None)
                outbox.wake()

            task.add_done_callback(done)

        async def read() -> None:
            async for cmd in request_iterator:
                for r in cmd.start:
                    admit(r)
                for rid in cmd.abort:
                    t = tasks.get(rid)
                    if t is not None:
                        t.cancel()

        reader = asyncio.get_running_loop().create_task(read(), name="steps-reader")
        try:
            while True:
                batch = await outbox.take(reader, lambda: reader.done() and not tasks)
                if batch is None:
                    break
                yield batch
        finally:
            reader.cancel()
            pending = list(tasks.values())
            for t in pending:
                t.cancel()
            await asyncio.gather(reader, *pending, return_exceptions=True)

    async def _step_request(self, request: pb.DecodeRequest, outbox: Outbox, direct: DirectSteps) -> None:
        """One request of a Steps stream: admit it; the engine thread writes its token deltas
        (``direct``) and hands the rest to the outbox (a callback per step, no task wake-up per
        step); this task only waits for the end. Cancelling it (router abort, stream gone)
        aborts the request."""
        node = self.node
        rid = request.request_id
        times = [time.monotonic()]  # admitted, first delta (traces)
        gate = node.drain_gate
        if gate is not None:
            gate.active += 1
        try:
            try:
                adm = await self._open(request)
            except _Refusal as r:
                outbox.end(rid, r.code, r.details)
                return
            loop = node.engine_loop
            assert loop is not None
            ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            interval = request.flush_interval_ms / 1000.0
            if interval > 0:
                direct.hold(rid, interval)  # merged on the engine thread, as Outbox would

            def on_delta(d: GenerationDelta) -> None:
                if ended.done():
                    return
                if len(times) == 1:
                    times.append(time.monotonic())
                if direct.takes(d):
                    # the engine thread wrote it; only its end is this callback's (finishing deltas)
                    if d.finish_reason is not None:
                        ended.set_result(None)
                    return
                if d.finish_reason == "error" and d.overloaded:
                    outbox.end(rid, grpc.StatusCode.RESOURCE_EXHAUSTED, d.error or "node is full")
                elif d.finish_reason == "error" and node.kv_consumer.wants_reprefill(rid):
                    outbox.end(
                        rid,
                        grpc.StatusCode.ABORTED,
                        f"{d.error} (kv_load_failure_policy reprefill)",
                        kv_load_failed=True,
                    )
                else:
                    outbox.put(d, interval)
                    if d.finish_reason is None:
                        return
                ended.set_result(None)

            try:
                await loop.admit(adm.prompt_token_ids, adm.params, rid, on_delta, direct=direct, **adm.kwargs)
            except PdserveError as e:
                outbox.end(rid, channel.error_to_status(e), str(e))
                return
            finished = False
            try:
                await ended
                finished = True
            finally:
                loop.release(rid, abort=not finished)
                if not finished:
                    outbox.drop(rid)
                pull = node.pull_times.pop(rid, [])
                if request.traceparent and tracing.enabled():
                    trace_decode(node, request, times, pull, finished)
        finally:
            # every exit drops the request's KV record: a refusal, a failed admit, the end, and a
            # cancellation while admitting (the router aborted or its stream went away)
            node.kv_consumer.forget(rid)
            direct.forget(rid)
            if gate is not None:
                gate.active -= 1

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        assert self.node.engine_loop is not None
        ids = list(request.request_ids)
        aborted = await self.node.engine_loop.call(lambda e: e.abort(ids))
        return pb.AbortResponse(num_aborted=len(aborted))

    async def GetLoad(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadReport:
        report = await self.node.answer_load(pb, context)
        report.num_pulls_in_flight = self.node.kv_consumer.pulls_in_flight()
        return report


class _Refusal(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


@dataclasses.dataclass
class _Admission:
    """What ``LLMEngine.add_request`` gets for a checked DecodeRequest."""

    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str
    kwargs: dict[str, Any]
