"""The node's front end in its own process: the router's Steps streams, off the engine's GIL.

A decode or colocated node with ``frontend_port`` set runs this as a child process (docs/design.md §7:
"whether the front end and the engine core share a process is a measured choice"):

    router --gRPC Steps (HTTP/2)--> front end (this process, frontend_port)
                                      | one Unix-socket connection per Steps stream, frames:
                                      | 4-byte big-endian length + a StepCommand / StepBatch
                                      v
                                    node process: DecodeServicer.steps_session (admission,
                                    outbox, engine thread), the node's own gRPC server for
                                    everything else (GetLoad, Abort, Decode, PushKV, health)

What moves out of the node process is gRPC's per-message work of the hot stream (HTTP/2
framing, flow control, aio's Cython callbacks: the largest part of the event loop's GIL share
in the profiles, docs/benchmarks.md); the node writes one frame per batch to a socket. This
process relays bytes: router commands are parsed only to refuse a malformed one
(INVALID_ARGUMENT), batches go to the router as the node serialized them.

Lifecycle: the node starts it and waits for its ready message; it exits when the node's end of
its pipe closes (the node stopped or died). The node watches it: if it dies the node turns
NOT_SERVING, fails its requests and stops with exit code 1, as for a dead pipeline stage. If
the node's socket closes under a stream, the stream ends UNAVAILABLE. The router learns the
address from GetLoad (``LoadReport.steps_address``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from pdserve.rpc import channel
from pdserve.rpc import node_pb2 as pb
from services.steps_direct import frame, read_frame
from services.steps_socket import StepsSocketServer

logger = logging.getLogger(__name__)
STEPS_METHOD = "Steps"
SERVICE = "pdserve.rpc.DecodeService"


# -- the front-end process -----------------------------------------------------------------------
class _Relay:
    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path

    async def steps(self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
        try:
            reader, writer = await asyncio.open_unix_connection(self.socket_path)
        except OSError as e:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"the node's engine process is not reachable: {e}"
            )
        bad: list[str] = []
        sent_all = asyncio.Event()

        async def pump() -> None:
            try:
                async for raw in request_iterator:
                    try:
                        pb.StepCommand.FromString(raw)
                    except DecodeError as e:
                        bad.append(f"malformed StepCommand: {e}")
                        writer.close()  # the node aborts this stream's requests
                        return
                    writer.write(frame(raw))
                    await writer.drain()
                sent_all.set()
                if writer.can_write_eof():
                    writer.write_eof()  # the router half-closed: the node finishes what runs
            except (ConnectionError, OSError):
                return

        pumping = asyncio.get_running_loop().create_task(pump(), name="steps-relay-pump")
        try:
            while True:
                try:
                    data = await read_frame(reader)
                except (ConnectionError, OSError, asyncio.IncompleteReadError):
                    data = None
                if data is None:
                    break
                yield data
        finally:
            pumping.cancel()
            with contextlib.suppress(BaseException):
                await pumping
            writer.close()
        if bad:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad[0])
        if not sent_all.is_set():
            # The node closed the stream while the router still had it open: it stopped or died.
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "the node's engine process ended the Steps stream"
            )


async def _serve(
    host: str,
    port: int,
    socket_path: str,
    shared_token: str | None,
    parent: Connection,
    max_receive_bytes: int,
) -> None:
    relay = _Relay(socket_path)
    interceptors = [channel.TokenAuthInterceptor(shared_token)] if shared_token else []
    options = channel.server_options(max_receive_bytes)
    server = grpc.aio.server(options=options, interceptors=interceptors)
    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            STEPS_METHOD: grpc.stream_stream_rpc_method_handler(
                relay.steps, request_deserializer=None, response_serializer=None
            )
        },
    )
    server.add_generic_rpc_handlers((handler,))
    try:
        bound = server.add_insecure_port(f"{host}:{port}")  # grpcio returns 0 or raises
    except RuntimeError:
        bound = 0
    if bound == 0:
        parent.send(("error", f"front end: cannot listen on {host}:{port}"))
        return
    await server.start()
    parent.send(("ready", bound))
    loop = asyncio.get_running_loop()
    gone = asyncio.Event()

    def on_pipe() -> None:  # a heartbeat from the node is answered; EOF = the node closed its end
        try:
            parent.send_bytes(parent.recv_bytes())
        except (EOFError, OSError):
            gone.set()
            loop.remove_reader(parent.fileno())

    loop.add_reader(parent.fileno(), on_pipe)
    await gone.wait()
    await server.stop(grace=1.0)


def frontend_main(
    host: str,
    port: int,
    socket_path: str,
    shared_token: str | None,
    parent: Connection,
    max_receive_bytes: int = channel.MAX_MESSAGE_BYTES,
) -> None:
    """Entry point of the front-end process (multiprocessing spawn)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # SIGTERM / SIGINT go to the node's whole process group: the node drains its streams through
    # this process and then closes the pipe, which is when this process stops.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        asyncio.run(_serve(host, port, socket_path, shared_token, parent, max_receive_bytes))
    except KeyboardInterrupt:  # pragma: no cover - SIGINT is ignored above
        pass


class FrontendProcess:
    """The Steps front-end process and the node's socket it relays to."""

    def describe(self) -> str:
        return f"Steps front end (pid {self.pid}), gRPC"

    @property
    def sessions_total(self) -> int:
        return self.socket.sessions_total

    def __init__(
        self,
        servicer: Any,
        host: str,
        port: int,
        shared_token: str | None,
        max_receive_bytes: int = channel.MAX_MESSAGE_BYTES,  # the node's (pdserve/rpc/limits.py)
    ) -> None:
        self.max_receive_bytes = max_receive_bytes
        self._dir = tempfile.mkdtemp(prefix="pdserve-fe-")  # 0700: only this user reaches the socket
        self.socket = StepsSocketServer(servicer)
        self.socket_path = os.path.join(self._dir, "steps.sock")
        self.host, self.port, self.token = host, port, shared_token
        self._proc: BaseProcess | None = None
        self._conn: Connection | None = None
        self._pings: collections.deque[float] = collections.deque()  # send times, unanswered

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def exitcode(self) -> int | None:
        return self._proc.exitcode if self._proc is not None else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def heartbeat(self) -> float:
        """Ping the process over its pipe and take the answers that came; returns how long the
        oldest unanswered ping has waited (0: none). A process that lives but does not run
        (stopped, wedged) stops answering: liveness alone would keep such a node in service with
        every stream through it stuck. Counted from the ping, so a node that pinged late (its own
        loop busy) does not blame the front end."""
        now = time.monotonic()
        if self._conn is None:
            return 0.0
        try:
            while self._conn.poll(0):
                self._conn.recv_bytes()
                if self._pings:
                    self._pings.popleft()
            self._conn.send_bytes(b"p")  # 1 byte: a pipe holds thousands of unanswered pings
            self._pings.append(now)
        except (EOFError, OSError):
            return 0.0  # the process is gone: alive() says so
        return now - self._pings[0] if len(self._pings) > 1 else 0.0

    async def start(self, timeout_s: float = 60.0) -> None:
        await self.socket.start_unix(self.socket_path)
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=frontend_main,
            args=(self.host, self.port, self.socket_path, self.token, child, self.max_receive_bytes),
            name="pdserve-frontend",
            daemon=True,
        )
        self._proc.start()
        child.close()
        self._conn = parent
        ready = await asyncio.get_running_loop().run_in_executor(None, self._wait_ready, timeout_s)
        if ready[0] != "ready":
            await self.stop()
            raise OSError(f"frontend_port {self.port}: {ready[1]}")
        self.port = int(ready[1])

    def _wait_ready(self, timeout_s: float) -> tuple[str, Any]:
        assert self._conn is not None and self._proc is not None
        if not self._conn.poll(timeout_s):
            return ("error", f"the front-end process did not start within {timeout_s:.0f} s")
        try:
            return tuple(self._conn.recv())  # type: ignore[return-value]
        except EOFError:
            return ("error", f"the front-end process exited ({self._proc.exitcode}) before listening")

    async def stop(self) -> None:
        if self._conn is not None:
            self._conn.close()  # the process exits on EOF
            self._conn = None
        if self._proc is not None:
            proc = self._proc
            await asyncio.get_running_loop().run_in_executor(None, proc.join, 5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        await self.socket.close()
        shutil.rmtree(self._dir, ignore_errors=True)
