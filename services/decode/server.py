"""The decode node: receives KV from prefill, generates the rest, streams tokens.

Also serves colocated requests (``remote_prefill`` false): prefill runs here, nothing moves.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from pdserve.engine.scheduler_output import KVLoadSpec
from pdserve.errors import PdserveError
from pdserve.kvtransfer.handshake import HandshakeError, HandshakeInfo, check_compat
from pdserve.kvtransfer.params import RemotePrefillParams
from pdserve.rpc import channel, convert
from pdserve.rpc import node_pb2 as pb
from pdserve.rpc import node_pb2_grpc as pb_grpc
from services.node import NodeBase, NodeOptions
from services.prefill.server import handshake_from_pb, handshake_to_pb

logger = logging.getLogger(__name__)


class DecodeNode(NodeBase):
    def __init__(self, opts: NodeOptions) -> None:
        super().__init__(opts)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._peers: dict[str, HandshakeInfo] = {}  # prefill address -> its handshake (epoch)
        self._pulls: set[asyncio.Task[None]] = set()
        self.pull_bytes_total = 0
        self.pull_seconds_total = 0.0
        self.pull_failures_total = 0

    def add_servicers(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(self), server)

    def transfer_counters(self) -> list[tuple[str, str, float]]:
        return [
            ("kv_transfer_bytes", "KV bytes received from prefill nodes", self.pull_bytes_total),
            ("kv_transfer_seconds", "Seconds spent waiting for KV pushes", self.pull_seconds_total),
            ("kv_transfer_failures", "KV pulls that failed", self.pull_failures_total),
        ]

    def _stub(self, address: str) -> pb_grpc.PrefillServiceStub:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = grpc.aio.insecure_channel(address, options=channel.OPTIONS)
        return pb_grpc.PrefillServiceStub(ch)

    async def ensure_handshake(self, address: str) -> HandshakeInfo:
        """Compare KV compatibility with a prefill node once per (address, epoch)."""
        known = self._peers.get(address)
        if known is not None:
            return known
        resp = await self._stub(address).Handshake(
            pb.HandshakeRequest(info=handshake_to_pb(self.handshake)),
            timeout=10.0,
            metadata=channel.auth_metadata(self.opts.shared_token),
        )
        remote = handshake_from_pb(resp.info)
        check_compat(self.handshake, remote)
        self._peers[address] = remote
        return remote

    # engine thread -> event loop: start the pulls a step asked for
    def _on_kv_loads(self, loads: list[KVLoadSpec]) -> None:
        assert self.loop is not None
        for spec in loads:
            self.loop.call_soon_threadsafe(self._start_pull, spec)

    def _start_pull(self, spec: KVLoadSpec) -> None:
        task = asyncio.get_running_loop().create_task(self._pull(spec))
        self._pulls.add(task)
        task.add_done_callback(self._pulls.discard)

    async def _pull(self, spec: KVLoadSpec) -> None:
        p = spec.params
        addr = p.prefill_address
        ok, err = False, ""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            peer = self._peers.get(addr) or await self.ensure_handshake(addr)
            req = pb.PushKVRequest(
                transfer_id=p.transfer_id,
                dst_block_ids=spec.block_ids[: -(-spec.num_tokens // self.engine.kv.block_size)],
                num_tokens=spec.num_tokens,
                dst_regions=[pb.Region(**r.to_dict()) for r in self.regions],
                dst_session=self.backend.session_id if self.backend else "",
                dst_compat_hash=self.handshake.compat_hash,
                expected_src_epoch=peer.epoch,
                # this node is one stage (pp > 1 on decode nodes is refused at start)
                dst_pp_rank=0,
                dst_tp_rank=0,
                dst_pp_size=1,
                dst_layer_start=0,
                dst_layer_end=self.engine.arch.num_hidden_layers,
            )
            resp = await self._stub(addr).PushKV(
                req,
                timeout=self.opts.kv_pull_timeout_s,
                metadata=channel.auth_metadata(self.opts.shared_token),
            )
            ok = p.transfer_id in resp.ok
            if ok:
                self.pull_bytes_total += resp.bytes
            else:
                err = f"prefill {addr} reported the write as failed"
        except grpc.aio.AioRpcError as e:
            err = f"{e.code().name} from prefill {addr}: {e.details()}"
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                self._peers.pop(addr, None)  # re-handshake next time (restart / mismatch)
        except (HandshakeError, PdserveError) as e:
            err = str(e)
        self.pull_seconds_total += loop.time() - t0
        if not ok:
            self.pull_failures_total += 1
            logger.warning(
                "KV pull %s failed: %s (policy %s)", p.transfer_id, err, self.opts.kv_load_failure_policy
            )
        policy = self.opts.kv_load_failure_policy
        assert self.engine_loop is not None
        self.engine_loop.post_and_dispatch(lambda e: e.finish_kv_load(spec.request_id, ok, policy, err))


class DecodeServicer(pb_grpc.DecodeServiceServicer):
    def __init__(self, node: DecodeNode) -> None:
        self.node = node

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext) -> Any:
        node = self.node
        try:
            params = convert.sampling_from_pb(request.sampling)
        except PdserveError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        kv_params = None
        if request.remote_prefill:
            if not request.transfer_id or not request.prefill_address or not request.output_token_ids:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "remote_prefill needs transfer_id, prefill_address and the first token",
                )
            try:
                await node.ensure_handshake(request.prefill_address)
            except HandshakeError as e:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"refused at handshake: {e}")
            except grpc.aio.AioRpcError as e:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE
                    if e.code() != grpc.StatusCode.FAILED_PRECONDITION
                    else grpc.StatusCode.FAILED_PRECONDITION,
                    f"handshake with prefill {request.prefill_address} failed: {e.details()}",
                )
            kv_params = RemotePrefillParams(request.transfer_id, request.prefill_address)
        embeds = None
        if request.HasField("prompt_embeds"):
            try:
                embeds = convert.tensor_from_pb(request.prompt_embeds)
            except PdserveError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"prompt_embeds: {e}")
        assert node.engine_loop is not None
        gen = node.engine_loop.generate(
            list(request.prompt_token_ids),
            params,
            request.request_id,
            kv_transfer_params=kv_params,
            output_token_ids=list(request.output_token_ids) or None,
            prompt_embeds=embeds,
        )
        try:
            async for d in gen:
                yield convert.delta_to_pb(d)
        except PdserveError as e:
            await context.abort(channel.error_to_status(e), str(e))
        finally:
            await gen.aclose()

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        assert self.node.engine_loop is not None
        ids = list(request.request_ids)
        aborted = await self.node.engine_loop.call(lambda e: e.abort(ids))
        return pb.AbortResponse(num_aborted=len(aborted))

    async def GetLoad(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadReport:
        return self.node.load_report(pb)
