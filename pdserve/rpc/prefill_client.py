"""Decode's gRPC client of prefill nodes: the ``PrefillPeer`` that ``KVConsumer`` is given.

One channel per prefill address, kept for the process. A failed call raises ``PeerCallError``
with the gRPC status name, so the consumer never sees a gRPC type.
"""

from __future__ import annotations

import grpc

from pdserve.kvtransfer.handshake import HandshakeInfo
from pdserve.kvtransfer.peer import KeepAliveReply, PeerCallError, PullReply, PullRequest
from pdserve.rpc import channel, kv_convert
from pdserve.rpc import node_pb2 as pb
from pdserve.rpc import node_pb2_grpc as pb_grpc

HANDSHAKE_TIMEOUT_S = 10.0  # one Handshake call (a live prefill answers in milliseconds)


class PrefillClient:
    def __init__(self, shared_token: str | None, handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
        self._metadata = channel.auth_metadata(shared_token)
        self.handshake_timeout_s = handshake_timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> pb_grpc.PrefillServiceStub:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = grpc.aio.insecure_channel(address, options=channel.OPTIONS)
        return pb_grpc.PrefillServiceStub(ch)

    async def handshake(self, address: str, info: HandshakeInfo) -> HandshakeInfo:
        try:
            resp = await self._stub(address).Handshake(
                pb.HandshakeRequest(info=kv_convert.handshake_to_pb(info)),
                timeout=self.handshake_timeout_s,
                metadata=self._metadata,
            )
        except grpc.aio.AioRpcError as e:
            raise _call_error(address, e) from e
        return kv_convert.handshake_from_pb(resp.info)

    async def push_kv(self, address: str, request: PullRequest, timeout_s: float) -> PullReply:
        try:
            resp = await self._stub(address).PushKV(
                kv_convert.pull_request_to_pb(request), timeout=timeout_s, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as e:
            raise _call_error(address, e) from e
        return kv_convert.pull_reply_from_pb(request.transfer_id, resp)

    async def keep_alive(self, address: str, transfer_ids: list[str], timeout_s: float) -> KeepAliveReply:
        try:
            resp = await self._stub(address).KeepAlive(
                pb.KeepAliveRequest(transfer_ids=transfer_ids), timeout=timeout_s, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as e:
            raise _call_error(address, e) from e
        return kv_convert.keep_alive_reply_from_pb(resp)

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            await ch.close()


def _call_error(address: str, e: grpc.aio.AioRpcError) -> PeerCallError:
    return PeerCallError(address, e.code().name, e.details() or "")
