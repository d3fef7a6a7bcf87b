"""The Steps socket's protocol (services/steps_socket.py) and the router's end of it
(services/router/step_mux.py: SocketSteps, StepMux): hello and welcome, the shared token, frame
limits before the hello, a stream-ending status. The node's servicer is a stand-in here (this
module's unit tests); tests/e2e/test_steps_socket_e2e.py runs the real node."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from pdserve.rpc import node_pb2 as pb
from pdserve.rpc.limits import STEP_COMMAND_BYTES
from services import steps_socket
from services.router.step_mux import SocketSteps, StepMux
from services.steps_direct import MAX_FRAME, frame, read_frame
from services.steps_socket import HELLO_MAX_BYTES, StepsFront


class _Echo:
    """Answers each started request with one finishing delta; a request named ``hang-*`` gets a
    first token and no end. ``ended``: sessions that ended (the node's abort their requests)."""

    def __init__(self) -> None:
        self.ended = 0

    async def steps_session(
        self, commands: AsyncIterator[pb.StepCommand], direct: Any
    ) -> AsyncIterator[pb.StepBatch]:
        try:
            async for cmd in commands:
                for r in cmd.start:
                    fin = "" if r.request_id.startswith("hang-") else "length"
                    yield pb.StepBatch(
                        deltas=[pb.Delta(request_id=r.request_id, token_ids=[7], finish_reason=fin)]
                    )
            await asyncio.Event().wait()  # a half-close: what runs would finish first
        finally:
            self.ended += 1


async def _front(token: str | None = None, **kw: Any) -> StepsFront:
    fe = StepsFront(_Echo(), "127.0.0.1", 0, token, **kw)
    await fe.start()
    return fe


async def _raw(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


def test_a_stream_after_the_hello_carries_commands_and_batches() -> None:
    async def main() -> None:
        fe = await _front("tok")
        try:
            s = await SocketSteps.connect(f"127.0.0.1:{fe.port}", "tok")
            await s.write(
                pb.StepCommand(start=[pb.DecodeRequest(request_id="a"), pb.DecodeRequest(request_id="b")])
            )
            got = []
            async for batch in s.batches():
                got += [(d.request_id, list(d.token_ids), d.finish_reason) for d in batch.deltas]
                if len(got) == 2:
                    break
            assert got == [("a", [7], "length"), ("b", [7], "length")]
            s.cancel()
            assert fe.sessions_total == 1 and fe.refused_total == 0
        finally:
            await fe.stop()

    asyncio.run(main())


@pytest.mark.parametrize("sent", [None, "wrong"])
def test_a_missing_or_wrong_token_is_unauthenticated(sent: str | None) -> None:
    async def main() -> None:
        fe = await _front("tok")
        try:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await SocketSteps.connect(f"127.0.0.1:{fe.port}", sent)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "shared token" in (e.value.details() or "")
            assert fe.sessions_total == 0 and fe.refused_total == 1
        finally:
            await fe.stop()

    asyncio.run(main())


def test_a_cluster_without_a_token_takes_any_hello() -> None:
    """As its gRPC ports take any call: a router given a token first is not locked out."""

    async def main() -> None:
        fe = await _front(None)
        try:
            (await SocketSteps.connect(f"127.0.0.1:{fe.port}", None)).cancel()
            (await SocketSteps.connect(f"127.0.0.1:{fe.port}", "rolled-out-first")).cancel()
            assert fe.refused_total == 0
        finally:
            await fe.stop()

    asyncio.run(main())


def test_the_routers_close_ends_the_stream_at_once() -> None:
    """The router closes its connection only when done with the stream (a restart, a crash):
    the node ends the session then -- its requests are aborted -- instead of running them on."""

    async def main() -> None:
        echo = _Echo()
        fe = StepsFront(echo, "127.0.0.1", 0, None)
        await fe.start()
        try:
            s = await SocketSteps.connect(f"127.0.0.1:{fe.port}", None)
            await s.write(pb.StepCommand(start=[pb.DecodeRequest(request_id="hang-1")]))
            assert (await anext(s.batches())).deltas[0].request_id == "hang-1"
            s.cancel()  # a clean close (FIN), not a reset
            for _ in range(100):
                if echo.ended:
                    break
                await asyncio.sleep(0.02)
            assert echo.ended == 1
        finally:
            await fe.stop()

    asyncio.run(main())


def test_a_new_connection_past_the_per_peer_cap_closes_the_oldest_waiting_one() -> None:
    """Idle strangers from the router's own address cannot keep the router out: the newest
    connection gets in (and its hello is answered), the oldest silent one is closed."""

    async def main() -> None:
        fe = await _front("tok", max_pending_per_peer=2, hello_timeout_s=5.0)
        try:
            silent = [await _raw(fe.port) for _ in range(2)]
            await asyncio.sleep(0.05)
            s = await SocketSteps.connect(f"127.0.0.1:{fe.port}", "tok")  # the third: welcomed
            assert await asyncio.wait_for(silent[0][0].read(), 5) == b""  # the oldest: closed
            third = await _raw(fe.port)  # a fourth closes the next oldest, the second silent one
            assert await asyncio.wait_for(silent[1][0].read(), 5) == b""
            assert fe.refused_total == 2
            s.cancel()
            for _, sw in [*silent, third]:
                sw.close()
        finally:
            await fe.stop()

    asyncio.run(main())


def test_connections_of_all_peers_waiting_are_capped(monkeypatch) -> None:
    monkeypatch.setattr(steps_socket, "MAX_PENDING_HELLOS", 2)

    async def main() -> None:
        fe = await _front(None, max_pending_per_peer=10, hello_timeout_s=5.0)
        try:
            silent = [await _raw(fe.port) for _ in range(3)]  # the third closes the first
            assert await asyncio.wait_for(silent[0][0].read(), 5) == b""
            assert fe.refused_total == 1
            for _, sw in silent:
                sw.close()
        finally:
            await fe.stop()

    asyncio.run(main())


def test_nothing_listening_is_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: the connection is refused

        async def main() -> None:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await SocketSteps.connect(f"127.0.0.1:{port}", None)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE

        asyncio.run(main())


def test_no_hello_in_time_or_an_oversized_one_is_closed_unread() -> None:
    async def main() -> None:
        fe = await _front("tok", hello_timeout_s=0.2)
        try:
            r, w = await _raw(fe.port)  # says nothing
            assert await asyncio.wait_for(r.read(), 5) == b""  # closed by the node
            w.close()
            r, w = await _raw(fe.port)
            w.write((HELLO_MAX_BYTES + 1).to_bytes(4, "big"))  # a huge "hello" is never read
            await w.drain()
            assert await asyncio.wait_for(r.read(), 5) == b""
            w.close()
            assert fe.refused_total == 2 and fe.sessions_total == 0
        finally:
            await fe.stop()

    asyncio.run(main())


def test_a_malformed_command_ends_the_stream_with_invalid_argument() -> None:
    async def main() -> None:
        fe = await _front(None)
        try:
            r, w = await _raw(fe.port)
            w.write(frame(pb.StepsHello().SerializeToString()))
            welcome = await read_frame(r)
            assert welcome is not None and pb.StepsWelcome.FromString(welcome).code == 0
            w.write(frame(b"\xff\xff\xff"))
            last = pb.StepBatch.FromString(await asyncio.wait_for(read_frame(r), 5) or b"")
            assert last.stream_end.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert "malformed StepCommand" in last.stream_end.details
            assert await asyncio.wait_for(read_frame(r), 5) is None  # then the node closes
            w.close()
        finally:
            await fe.stop()

    asyncio.run(main())


def test_a_command_over_the_frame_limit_ends_the_stream_with_resource_exhausted() -> None:
    async def main() -> None:
        fe = await _front(None)
        try:
            r, w = await _raw(fe.port)
            w.write(frame(pb.StepsHello().SerializeToString()))
            assert await read_frame(r) is not None
            w.write((MAX_FRAME + 1).to_bytes(4, "big"))  # announced, never sent: not read
            last = pb.StepBatch.FromString(await asyncio.wait_for(read_frame(r), 5) or b"")
            assert last.stream_end.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            assert "over the" in last.stream_end.details
            w.close()
        finally:
            await fe.stop()

    asyncio.run(main())


def test_the_mux_fails_its_open_legs_with_the_streams_end_status() -> None:
    """A batch with stream_end fails every leg still open with that code; the next leg opens a
    new connection."""

    async def main() -> None:
        async def node(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await read_frame(r)  # hello
            w.write(frame(pb.StepsWelcome().SerializeToString()))
            cmd = pb.StepCommand.FromString(await read_frame(r) or b"")
            w.write(
                frame(
                    pb.StepBatch(
                        deltas=[pb.Delta(request_id=cmd.start[0].request_id, token_ids=[3])]
                    ).SerializeToString()
                )
            )
            end = pb.StepEnd(code=grpc.StatusCode.INVALID_ARGUMENT.value[0], details="bad command")
            w.write(frame(pb.StepBatch(stream_end=end).SerializeToString()))
            await w.drain()

        server = await asyncio.start_server(node, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        opened: list[int] = []
        broken: list[int] = []
        mux = StepMux(
            lambda: SocketSteps.connect(f"127.0.0.1:{port}", None),
            on_open=lambda: opened.append(1),
            on_break=broken.append,
        )
        try:
            leg = mux.open(pb.DecodeRequest(request_id="x"), timeout_s=10)
            assert list((await leg.read()).token_ids) == [3]
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await leg.read()
            # the stream's failure, not the request's: UNAVAILABLE, the node's code and reason said
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "INVALID_ARGUMENT: bad command" in (e.value.details() or "")
            leg2 = mux.open(pb.DecodeRequest(request_id="y"), timeout_s=10)
            assert list((await leg2.read()).token_ids) == [3]
            assert mux.streams_opened == 2 and len(opened) == 2
            assert broken[:1] == [1]  # the first stream broke under its one open leg
        finally:
            await mux.close()
            server.close()

    asyncio.run(main())


def test_stopping_the_front_ends_its_streams() -> None:
    async def main() -> None:
        fe = await _front(None)
        s = await SocketSteps.connect(f"127.0.0.1:{fe.port}", None)
        await s.write(pb.StepCommand(start=[pb.DecodeRequest(request_id="hang-1")]))
        batches = s.batches()
        first = await anext(batches)
        assert first.deltas[0].request_id == "hang-1"
        await asyncio.wait_for(fe.stop(), 5)
        with pytest.raises(StopAsyncIteration):  # the node closed the connection
            await asyncio.wait_for(anext(batches), 5)
        s.cancel()

    asyncio.run(main())


def test_the_router_sends_many_starts_in_commands_of_a_bounded_size() -> None:
    """A burst of starts goes out in commands of at most STEP_COMMAND_BYTES (each within the
    node's receive limit, pdserve/rpc/limits.py); every request still runs, aborts after the starts."""

    class Recording(_Echo):
        def __init__(self) -> None:
            super().__init__()
            self.sizes: list[tuple[int, int, int]] = []

        async def steps_session(self, commands: AsyncIterator[pb.StepCommand], direct: Any):  # type: ignore[no-untyped-def]
            async def recorded() -> AsyncIterator[pb.StepCommand]:
                async for cmd in commands:
                    self.sizes.append((len(cmd.start), len(cmd.abort), cmd.ByteSize()))
                    yield cmd

            async for batch in super().steps_session(recorded(), direct):
                yield batch

    async def main() -> None:
        node = Recording()
        fe = StepsFront(node, "127.0.0.1", 0, None)
        await fe.start()
        mux = StepMux(lambda: SocketSteps.connect(f"127.0.0.1:{fe.port}", None))
        try:
            n = 11  # 1 MiB of prompt each: four to a command
            ids = [1 << 27] * ((1 << 18) - 16)  # 4-byte varints: just under 1 MiB
            legs = [
                mux.open(pb.DecodeRequest(request_id=f"r{i}", prompt_token_ids=ids), timeout_s=10)
                for i in range(n)
            ]
            extra = mux.open(pb.DecodeRequest(request_id="hang-x"), timeout_s=10)
            extra.cancel()  # queued with the burst: its abort follows its start
            for leg in legs:
                assert (await leg.read()).finish_reason == "length"
            assert sum(s for s, _, _ in node.sizes) == n + 1
            assert [s for s, _, _ in node.sizes] == [4, 4, 4]
            assert max(b for _, _, b in node.sizes) <= STEP_COMMAND_BYTES + 64
            assert [a for _, a, _ in node.sizes] == [0, 0, 1]
        finally:
            await mux.close()
            await fe.stop()

    asyncio.run(main())
