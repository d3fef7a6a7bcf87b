"""The shared-token check refuses by metadata: the servicer never runs and the message is never
parsed (nor, for a request-streaming handler, read); real gRPC on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from pdserve.rpc import channel
from pdserve.rpc.limits import (
    BASE_BYTES,
    MARGIN,
    STEP_COMMAND_BYTES,
    command_split,
    encoder_receive_limit_bytes,
    node_receive_limit_bytes,
    request_bytes,
)

TOKEN = "t0ken"


class _Probe:
    """A generic service with one method of each shape, counting calls and parses."""

    def __init__(self) -> None:
        self.calls = 0
        self.parsed = 0

    def parse(self, raw: bytes) -> bytes:
        self.parsed += 1
        return raw

    async def unary(self, req: bytes, ctx: Any) -> bytes:
        self.calls += 1
        return b"ok:" + req[:8]

    async def server_stream(self, req: bytes, ctx: Any) -> AsyncIterator[bytes]:
        self.calls += 1
        yield b"ok"

    async def bidi(self, reqs: AsyncIterator[bytes], ctx: Any) -> AsyncIterator[bytes]:
        self.calls += 1
        async for r in reqs:
            yield r

    def handler(self) -> grpc.GenericRpcHandler:
        kw = {"request_deserializer": self.parse}
        return grpc.method_handlers_generic_handler(
            "probe.Probe",
            {
                "Unary": grpc.unary_unary_rpc_method_handler(self.unary, **kw),
                "ServerStream": grpc.unary_stream_rpc_method_handler(self.server_stream, **kw),
                "Bidi": grpc.stream_stream_rpc_method_handler(self.bidi, **kw),
            },
        )


def test_calls_without_the_token_are_refused_unparsed_and_with_it_served() -> None:
    async def main() -> None:
        probe = _Probe()
        server = grpc.aio.server(
            options=channel.SERVER_OPTIONS, interceptors=[channel.TokenAuthInterceptor(TOKEN)]
        )
        server.add_generic_rpc_handlers((probe.handler(),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel.OPTIONS) as ch:
                unary = ch.unary_unary("/probe.Probe/Unary")
                sstream = ch.unary_stream("/probe.Probe/ServerStream")
                bidi = ch.stream_stream("/probe.Probe/Bidi")
                big = b"x" * (8 << 20)
                for md in (None, (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await unary(big, metadata=md, timeout=10)
                    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        async for _ in sstream(b"hi", metadata=md, timeout=10):
                            pass
                    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        async for _ in bidi(iter([]), metadata=md, timeout=10):
                            pass
                    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    # The node ends the call at its metadata; a client still writing its request
                    # stream may see its own write fail (INTERNAL, from the send) before it reads
                    # that status. Either way nothing reaches the handler (checked below).
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        async for _ in bidi(iter([b"a", b"b"]), metadata=md, timeout=10):
                            pass
                    code = e.value.code()
                    assert code == grpc.StatusCode.UNAUTHENTICATED or (
                        code == grpc.StatusCode.INTERNAL and "SendMessage" in e.value.debug_error_string()
                    ), e.value
                assert probe.calls == 0 and probe.parsed == 0
                md = (("authorization", f"Bearer {TOKEN}"),)
                assert await unary(b"hello", metadata=md, timeout=10) == b"ok:hello"
                assert [r async for r in bidi(iter([b"a", b"b"]), metadata=md, timeout=10)] == [b"a", b"b"]
                assert probe.calls == 2 and probe.parsed == 3
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_a_node_receive_limit_follows_its_model() -> None:
    tiny = node_receive_limit_bytes(2048, 64)
    per_request = 2 * 2048 * 64 * 4 + 2048 * 64
    assert request_bytes(2048, 64) == per_request
    assert tiny == int((BASE_BYTES + STEP_COMMAND_BYTES + per_request) * MARGIN)
    assert 10 << 20 < tiny < 12 << 20  # 11.4 MiB, not 512 MiB
    # image bytes count once per image the context can hold
    with_images = request_bytes(2048, 64, max_image_bytes=1 << 20, image_tokens=500)
    assert with_images == per_request + 4 * (1 << 20)
    assert 89 << 20 < node_receive_limit_bytes(2048, 4096) < 91 << 20
    assert node_receive_limit_bytes(16384, 4096) == channel.MAX_MESSAGE_BYTES  # capped
    assert encoder_receive_limit_bytes(20 << 20) == int(((4 << 20) + (20 << 20)) * MARGIN)


class _Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def ByteSize(self) -> int:
        return self.n


def test_a_steps_command_takes_starts_up_to_its_byte_budget_and_at_least_one() -> None:
    mib = 1 << 20
    assert command_split([_Sized(mib)] * 10) == 4  # 4 MiB: four fit, the fifth would pass it
    assert command_split([_Sized(9 * mib), _Sized(1)]) == 1  # one large start goes alone
    assert command_split([_Sized(1)] * 3) == 3
    assert command_split([_Sized(1), _Sized(9 * mib)]) == 1


def test_server_options_replace_only_the_receive_limit() -> None:
    opts = dict(channel.server_options(3 << 20))
    assert opts["grpc.max_receive_message_length"] == 3 << 20
    assert opts["grpc.max_send_message_length"] == channel.MAX_MESSAGE_BYTES
    assert opts["grpc.so_reuseport"] == 0
    assert len(channel.server_options(3 << 20)) == len(channel.SERVER_OPTIONS)
