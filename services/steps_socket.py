"""A node's Steps socket: the router's token streams, on a TCP port of length-prefixed frames.

A decode or colocated node serves the router's token streams (``Steps``: commands in, one
``StepBatch`` per engine step out) here, and only here::

    router --TCP, length-prefixed frames (one connection = one stream)--> node

The node's end is :class:`StepsSocketServer`: its event loop reads ``StepCommand`` frames
(admissions, aborts) and its **engine thread writes each step's token deltas to the socket
itself** (services/steps_direct.py), so neither the event loop nor any HTTP/2 work sits between
a step and the router. Against gRPC through a front-end process, on the 2-core VM the time to
first token at one stream fell from 6.2 to 4.1 ms in a hop probe and its p50 from 6.1 to 5.1
ms through bench/served.py (docs/benchmarks.md, "The Steps socket"). Everything else between
router and node stays gRPC (GetLoad, Abort, PushKV).

The TCP port speaks, per connection (one connection = one Steps stream):

    router -> node   StepsHello {token}              first frame, within hello_timeout_s
    node -> router   StepsWelcome {code, details}    OK, or UNAUTHENTICATED and the node closes
    router -> node   StepCommand frames              starts and aborts of decode legs
    node -> router   StepBatch frames                each step's deltas and ends; a batch with
                                                     ``stream_end`` is the last (the stream's status)

Frames: a 4-byte big-endian length, then the message. Before the hello is accepted a frame may
be at most ``HELLO_MAX_BYTES`` (an unauthenticated peer cannot make the node buffer more).
Strangers cannot hold the door: a connection without its hello after ``hello_timeout_s`` (1 s
by default) is closed; at most ``max_pending_per_peer`` connections of one peer address (4)
and ``MAX_PENDING_HELLOS`` in all wait for their hello, and a new connection past either
closes the **oldest** waiting one instead of being refused, so the router's connection, whose
hello follows its connect at once, is never turned away by idle connections (200 of them from
the router's own address did not stop its streams: tests/e2e/test_listening_ports_e2e.py).
A malformed command ends the stream with ``stream_end`` INVALID_ARGUMENT and aborts its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from pdserve.rpc import node_pb2 as pb
from services.sockets import listening_socket
from services.steps_direct import DirectSteps, FrameTooLarge, SocketFrames, frame, read_frame

logger = logging.getLogger(__name__)
HELLO_MAX_BYTES = 4096
HELLO_TIMEOUT_S = 1.0  # default of nodes[].steps_hello_timeout_s
MAX_PENDING_PER_PEER = 4  # default of nodes[].steps_max_pending_per_peer
MAX_PENDING_HELLOS = 1024  # waiting connections of all peers; a newer one closes the oldest
# A peer that vanished (host down, cable out) is noticed within ~15 s, as gRPC's keepalive pings
# notice it on the other calls (pdserve/rpc/channel.py): keepalive probes on an idle connection,
# TCP_USER_TIMEOUT while sent data waits for its acknowledgement (retransmits alone take ~15 min).
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 5, 2, 3
USER_TIMEOUT_MS = 15_000
REFUSAL_LOG_EVERY_S = 10.0


def tune_stream_socket(sock: socket.socket) -> None:
    """TCP_NODELAY (a step's batch goes out at once) and keepalive probes on a Steps connection."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
        ("TCP_USER_TIMEOUT", USER_TIMEOUT_MS),
    ):
        if hasattr(socket, opt):  # Linux; other systems keep their defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


def end_frame(code: grpc.StatusCode, details: str) -> bytes:
    """A ``StepBatch`` that ends the stream with ``code`` (the socket transport's status)."""
    return pb.StepBatch(stream_end=pb.StepEnd(code=code.value[0], details=details)).SerializeToString()


class StepsSocketServer:
    """The node's end of Steps streams: each connection ``serve`` gets is one stream of
    ``servicer`` (``DecodeServicer.steps_session``)."""

    def __init__(self, servicer: Any) -> None:
        self.servicer = servicer
        self.sessions_total = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One Steps stream on an accepted connection, until either side ends it. The router
        closes its connection only when it is done with the stream: end of stream from it aborts
        every request of the stream at once."""
        self.sessions_total += 1
        session = asyncio.current_task()
        ending: str | None = None  # why this side ends the stream (the peer is gone, or erred)
        sent_end = False  # and told the peer in a stream_end frame

        # Token deltas: the engine thread writes them to this socket (services/steps_direct.py);
        # this coroutine writes the rest (ends, error deltas) through the same ordered frames.
        sock = writer.get_extra_info("socket")

        # A failed write (the peer went away) ends the session: its requests are aborted.
        def on_fail() -> None:
            if session is not None:
                session.cancel()

        frames = SocketFrames(sock.fileno(), asyncio.get_running_loop(), on_fail)

        def end(why: str, code: grpc.StatusCode | None = None) -> None:
            """End the stream from this side (its requests are aborted); ``code``: tell the
            peer why in a last ``stream_end`` frame."""
            nonlocal ending, sent_end
            ending = why
            if code is not None:
                frames.write(end_frame(code, why))
                sent_end = True
            on_fail()

        async def commands() -> AsyncIterator[pb.StepCommand]:
            while True:
                try:
                    data = await read_frame(reader)
                    if data is None:
                        end("the router closed the stream")
                        return
                    cmd = pb.StepCommand.FromString(data)
                except DecodeError as e:
                    end(f"malformed StepCommand: {e}", grpc.StatusCode.INVALID_ARGUMENT)
                    return
                except FrameTooLarge as e:
                    end(f"StepCommand refused: {e}", grpc.StatusCode.RESOURCE_EXHAUSTED)
                    return
                except OSError as e:  # reset, cut short (ConnectionError): the peer is gone
                    end(f"the peer's connection failed: {e!r}")
                    return
                yield cmd

        try:
            async for batch in self.servicer.steps_session(commands(), DirectSteps(frames)):
                frames.write(batch.SerializeToString())
                await frames.drain()  # a failed write cancels this task (on_fail)
        except asyncio.CancelledError:
            if not (frames.closed or ending):
                raise  # the node is stopping
            logger.info(
                "Steps socket session ended, its requests aborted: %s", ending or "a write to the peer failed"
            )
            if sent_end:  # let the stream_end frame out before the socket closes
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(frames.drain(0), 1.0)
        finally:
            frames.close()
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


class StepsFront:
    """The Steps socket: the router's Steps streams straight to the node on a TCP port.

    Each connection starts with StepsHello / StepsWelcome (the shared token, if the cluster has
    one; without one any hello is taken, as the gRPC ports take any call), then is one
    :class:`StepsSocketServer` stream. The node's ``_start_frontend`` starts it."""

    def __init__(
        self,
        servicer: Any,
        host: str,
        port: int,
        shared_token: str | None,
        *,
        hello_timeout_s: float = HELLO_TIMEOUT_S,
        max_pending_per_peer: int = MAX_PENDING_PER_PEER,
    ) -> None:
        self.sessions = StepsSocketServer(servicer)
        self.host, self.port = host, port
        self._token = shared_token.encode() if shared_token else None
        self._hello_timeout_s = hello_timeout_s
        self._max_pending_per_peer = max_pending_per_peer
        self._server: asyncio.AbstractServer | None = None
        self._open: set[asyncio.Task[Any]] = set()  # connections being served
        self._stopping = False
        # Connections waiting for their hello, oldest first: writer -> peer address.
        self._waiting: dict[asyncio.StreamWriter, str] = {}
        self.refused_total = 0  # connections turned away before a stream (no hello, wrong token, too many)
        self._refusal_logged_at = float("-inf")

    def describe(self) -> str:
        return "Steps socket (TCP frames, served by this process)"

    @property
    def sessions_total(self) -> int:
        return self.sessions.sessions_total

    async def start(self) -> None:
        """Listen (``port`` 0: any free one; ``port`` is then the bound one); OSError naming the
        port if it cannot."""
        try:
            sock = listening_socket(self.host or None, self.port, dual_stack=True)
        except OSError as e:
            why = e.strerror if e.errno and e.errno > 0 and e.strerror else str(e)
            raise OSError(
                f"frontend_port {self.port}: Steps socket: cannot listen on {self.host}:{self.port} ({why})"
            ) from e
        self._server = await asyncio.start_server(self._accept, sock=sock)
        self.port = sock.getsockname()[1]

    async def stop(self) -> None:
        """Stop listening and end every stream (its requests are aborted; the router sees the
        connection close: UNAVAILABLE)."""
        self._stopping = True
        if self._server is not None:
            self._server.close()
        for t in list(self._open):
            t.cancel()
        await asyncio.gather(*self._open, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    def _refused(self, why: str) -> None:
        self.refused_total += 1
        now = time.monotonic()
        if now - self._refusal_logged_at >= REFUSAL_LOG_EVERY_S:  # a flood logs a line per 10 s
            self._refusal_logged_at = now
            logger.warning("Steps socket: a connection was refused (%s; %d so far)", why, self.refused_total)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        try:
            if self._stopping:
                return
            self._open.add(task)
            self._make_room(writer)
            try:
                ok = await self._welcome(reader, writer)
            finally:
                self._waiting.pop(writer, None)
            if ok and not self._stopping:
                await self.sessions.serve(reader, writer)
        except asyncio.CancelledError:
            if not self._stopping:
                raise
            # stop() ended this stream: the handler ends normally (asyncio's streams log a
            # connection handler that ends cancelled as an error)
        finally:
            self._open.discard(task)
            writer.close()

    def _make_room(self, writer: asyncio.StreamWriter) -> None:
        """Count ``writer`` as waiting for its hello; past ``max_pending_per_peer`` waiting of
        its peer address, or MAX_PENDING_HELLOS of all, close the oldest one waiting."""
        peer = writer.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        same = [w for w, a in self._waiting.items() if a == address]
        oldest = None
        if len(same) >= self._max_pending_per_peer:
            oldest = same[0]
        elif len(self._waiting) >= MAX_PENDING_HELLOS:
            oldest = next(iter(self._waiting))
        if oldest is not None:  # its _welcome reads end of stream and counts the refusal
            del self._waiting[oldest]
            oldest.transport.abort()
        self._waiting[writer] = address

    async def _welcome(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Read the hello and answer it; whether the stream may start."""
        sock = writer.get_extra_info("socket")
        if sock is not None:
            tune_stream_socket(sock)
        try:
            data = await asyncio.wait_for(read_frame(reader, HELLO_MAX_BYTES), self._hello_timeout_s)
            if data is None:
                raise ConnectionError("closed before its hello")
            hello = pb.StepsHello.FromString(data)
        except (TimeoutError, OSError, DecodeError) as e:
            self._refused(f"no valid hello: {e!r}")
            return False
        ok = self._token is None or hmac.compare_digest(hello.token.encode(), self._token)
        welcome = pb.StepsWelcome()
        if not ok:
            self._refused("a missing or wrong shared token")
            welcome.code = grpc.StatusCode.UNAUTHENTICATED.value[0]
            welcome.details = "missing or wrong shared token (the cluster's shared_token)"
        try:
            writer.write(frame(welcome.SerializeToString()))
            await writer.drain()
        except OSError:
            return False
        return ok
