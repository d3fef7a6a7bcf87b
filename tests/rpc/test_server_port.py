"""A node's gRPC server never shares its port with another server (no SO_REUSEPORT)."""

import asyncio

import grpc
import pytest

from pdserve.rpc import channel


def test_a_second_server_on_a_taken_port_fails_to_bind() -> None:
    async def run() -> None:
        first = grpc.aio.server(options=channel.SERVER_OPTIONS)
        port = first.add_insecure_port("127.0.0.1:0")
        await first.start()
        try:
            second = grpc.aio.server(options=channel.SERVER_OPTIONS)
            with pytest.raises(RuntimeError, match="Failed to bind"):
                second.add_insecure_port(f"127.0.0.1:{port}")
        finally:
            await first.stop(None)

    asyncio.run(run())
