"""The decode node: receives KV from prefill, generates the rest, streams tokens.

Also serves colocated requests (``remote_prefill`` false): prefill runs here, nothing moves.
``DecodeNode`` wires the engine to its KVConsumer (the pulls a step asks for, their end back to
the engine, the pull metrics); ``DecodeServicer`` is its DecodeService. Both of its token paths
admit through services/decode/admission.py; the Steps stream runs in
services/decode/steps_session.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from prometheus_client import Histogram

from pdserve import tracing
from pdserve.config.choices import KvLoadFailurePolicy
from pdserve.config.node_spec import NodeSpec
from pdserve.errors import PdserveError
from pdserve.kvtransfer.checksum import kv_blocks_digest
from pdserve.kvtransfer.consumer import KVConsumer
from pdserve.kvtransfer.load_policy import KV_LOAD_FAILED_KEY
from pdserve.kvtransfer.params import KVLoadSpec
from pdserve.rpc import channel, convert
from pdserve.rpc import node_pb2 as pb
from pdserve.rpc import node_pb2_grpc as pb_grpc
from pdserve.rpc.prefill_client import PrefillClient
from services.decode.admission import Refusal, open_request
from services.decode.steps_session import run_steps_session
from services.lora_rpc import LoRAServicer
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

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext) -> Any:
        node = self.node
        try:
            adm = await open_request(node, request)
        except Refusal as r:
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

    def steps_session(
        self, request_iterator: AsyncIterator[pb.StepCommand], direct: DirectSteps
    ) -> AsyncIterator[pb.StepBatch]:
        """One Steps stream (services/decode/steps_session.py), served by the Steps socket
        (services/steps_socket.py)."""
        return run_steps_session(self.node, request_iterator, direct)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        assert self.node.engine_loop is not None
        ids = list(request.request_ids)
        aborted = await self.node.engine_loop.call(lambda e: e.abort(ids))
        return pb.AbortResponse(num_aborted=len(aborted))

    async def GetLoad(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadReport:
        report = await self.node.answer_load(pb, context)
        report.num_pulls_in_flight = self.node.kv_consumer.pulls_in_flight()
        return report
