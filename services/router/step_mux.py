"""One multiplexed ``Steps`` stream per decode-capable node: the router's only token path.

Every decode leg the router has on a node shares one stream: a leg's start and its abort are
commands on it, and each batch the node sends holds one merged delta per request (all tokens
since its previous batch). The router's work is then per engine step, not per token and
stream; a leg whose consumer lags reads everything queued as one delta.

The stream is a TCP connection of length-prefixed frames to the node's Steps socket (the
address in ``LoadReport.steps_socket``; services/steps_socket.py), read with plain asyncio
streams: no HTTP/2 work per batch on either end, and on the node the engine thread writes each
step's frame itself (services/steps_direct.py). Against a gRPC stream through a front-end
process it cut the first token at one stream from 6.2 to 4.1 ms on the 2-core VM and raised
the served path from 0.81-0.85 to 0.88-0.91 of the in-process engine (docs/benchmarks.md, "The
Steps socket" and "The served path on CPU").

A leg (``read()``, ``cancel()``) reports failures as ``grpc.aio.AioRpcError`` statuses, as the
other legs' gRPC calls do. When the stream breaks (node gone, restart) every open leg fails
UNAVAILABLE, and the next leg opens a new stream. A ``stream_end`` from the node fails every
open leg UNAVAILABLE (the node's code and reason in the details): it is the stream's failure,
not the clients' requests'.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol, TypeAlias

import grpc
from google.protobuf.message import DecodeError

from pdserve.kvtransfer.load_policy import KV_LOAD_FAILED_KEY
from pdserve.rpc import node_pb2 as pb
from pdserve.rpc.limits import command_split
from services.steps_direct import frame, read_frame
from services.steps_socket import HELLO_MAX_BYTES, tune_stream_socket

logger = logging.getLogger(__name__)
_CODES = {c.value[0]: c for c in grpc.StatusCode}


def status_error(
    code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()
) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details=details)


def merge_pb_deltas(a: pb.Delta, b: pb.Delta) -> pb.Delta:
    """``b`` appended to ``a`` (same request; ``a`` is not finished). Mutates and returns ``a``."""
    a.token_ids.extend(b.token_ids)
    a.text += b.text
    a.logprobs.extend(b.logprobs)
    a.has_logprobs = a.has_logprobs or b.has_logprobs
    a.finish_reason = b.finish_reason
    a.stop_reason = b.stop_reason
    if b.HasField("stop_token_id"):
        a.stop_token_id = b.stop_token_id
    else:
        a.ClearField("stop_token_id")
    for f in ("num_prompt_tokens", "num_output_tokens", "num_cached_tokens"):
        if getattr(b, f):
            setattr(a, f, getattr(b, f))
    a.error = b.error
    return a


_Item: TypeAlias = pb.Delta | grpc.aio.AioRpcError
STEPS_CONNECT_TIMEOUT_S = 10.0  # TCP connect + hello / welcome of a Steps socket


class StepsStream(Protocol):
    """One open Steps stream (``SocketSteps``); failures raise ``grpc.aio.AioRpcError``."""

    async def write(self, cmd: pb.StepCommand) -> None: ...

    def batches(self) -> AsyncIterator[pb.StepBatch]: ...

    def cancel(self) -> None: ...


class SocketSteps:
    """A Steps stream on the node's Steps socket (services/steps_socket.py)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, where: str) -> None:
        self._r, self._w, self._where = reader, writer, where

    @classmethod
    async def connect(
        cls, address: str, token: str | None, timeout_s: float = STEPS_CONNECT_TIMEOUT_S
    ) -> SocketSteps:
        """Connect to ``host:port`` and pass the hello; UNAVAILABLE if the node is not there,
        the node's code (UNAUTHENTICATED) if it refuses."""
        host, _, port = address.rpartition(":")
        host = host.strip("[]")  # an IPv6 literal
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout_s)
        except (TimeoutError, OSError, ValueError) as e:
            raise status_error(grpc.StatusCode.UNAVAILABLE, f"Steps socket {address}: {e!r}") from None
        try:
            tune_stream_socket(writer.get_extra_info("socket"))
            writer.write(frame(pb.StepsHello(token=token or "").SerializeToString()))
            data = await asyncio.wait_for(read_frame(reader, HELLO_MAX_BYTES), timeout_s)
            if data is None:
                raise ConnectionError("the node closed the connection at the hello")
            welcome = pb.StepsWelcome.FromString(data)
        except (TimeoutError, OSError, DecodeError) as e:
            writer.close()
            raise status_error(grpc.StatusCode.UNAVAILABLE, f"Steps socket {address}: {e!r}") from None
        except BaseException:  # cancelled at the hello: do not leave the connection open
            writer.close()
            raise
        if welcome.code:
            writer.close()
            code = _CODES.get(welcome.code, grpc.StatusCode.UNKNOWN)
            raise status_error(code, f"Steps socket {address}: {welcome.details}")
        return cls(reader, writer, address)

    async def write(self, cmd: pb.StepCommand) -> None:
        try:
            self._w.write(frame(cmd.SerializeToString()))
            await self._w.drain()
        except OSError as e:
            raise status_error(grpc.StatusCode.UNAVAILABLE, f"Steps socket {self._where}: {e!r}") from None

    async def batches(self) -> AsyncIterator[pb.StepBatch]:
        while True:
            try:
                data = await read_frame(self._r)
                if data is None:
                    return
                yield pb.StepBatch.FromString(data)
            except (OSError, DecodeError) as e:
                raise status_error(
                    grpc.StatusCode.UNAVAILABLE, f"Steps socket {self._where}: {e!r}"
                ) from None

    def cancel(self) -> None:
        self._w.close()


class StepLeg:
    """One request (a decode leg) on a :class:`StepMux`."""

    def __init__(self, mux: StepMux, request_id: str, q: asyncio.Queue[_Item], timeout_s: float) -> None:
        self._mux = mux
        self.request_id = request_id
        self._q = q
        self._held: grpc.aio.AioRpcError | None = None
        self._deadline = asyncio.get_running_loop().time() + timeout_s

    async def read(self, timeout_s: float | None = None) -> pb.Delta:
        """The next delta, with everything else already queued for this leg merged into it.

        ``timeout_s``: the caller's own wait (the leg's inter-token deadline); past it
        ``TimeoutError`` is raised and the leg stays open. Past the request's deadline the leg
        is cancelled and DEADLINE_EXCEEDED raised. A delta already queued is returned at once,
        without a timer (a lagging reader pays nothing per delta for the deadlines)."""
        if self._held is not None:
            raise self._held
        if not self._q.empty():
            item = self._q.get_nowait()
        else:
            remaining = self._deadline - asyncio.get_running_loop().time()
            wait = remaining if timeout_s is None else min(remaining, timeout_s)
            try:
                if wait <= 0:
                    raise TimeoutError
                item = await asyncio.wait_for(self._q.get(), wait)
            except TimeoutError:
                if timeout_s is not None and timeout_s < remaining:
                    raise
                self.cancel()
                raise status_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        if isinstance(item, grpc.aio.AioRpcError):
            raise item
        while not item.finish_reason and not self._q.empty():
            nxt = self._q.get_nowait()
            if isinstance(nxt, grpc.aio.AioRpcError):
                self._held = nxt  # raised by the next read, after these tokens
                break
            item = merge_pb_deltas(item, nxt)
        return item

    def cancel(self) -> None:
        self._mux.abort(self.request_id)


class StepMux:
    """The Steps stream to one node; create and use inside the router's event loop.

    ``connect`` opens a stream (``SocketSteps.connect``); it runs again for the
    first leg after a stream ended. ``on_open``: called for each stream opened; ``on_break``: for
    each stream that ended with legs open, with their count (the router's metrics)."""

    def __init__(
        self,
        connect: Callable[[], Awaitable[StepsStream]],
        on_open: Callable[[], None] | None = None,
        on_break: Callable[[int], None] | None = None,
    ) -> None:
        self._connect = connect
        self._on_open = on_open
        self._on_break = on_break
        self._queues: dict[str, asyncio.Queue[_Item]] = {}
        self._starts: list[pb.DecodeRequest] = []
        self._aborts: list[str] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.streams_opened = 0

    def open(self, msg: pb.DecodeRequest, timeout_s: float) -> StepLeg:
        if self._task is None or self._task.done():
            self.streams_opened += 1
            if self._on_open is not None:
                self._on_open()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="steps-stream")
        q: asyncio.Queue[_Item] = asyncio.Queue()
        self._queues[msg.request_id] = q
        self._starts.append(msg)
        self._wake.set()
        return StepLeg(self, msg.request_id, q, timeout_s)

    def abort(self, request_id: str) -> None:
        """Stop reading ``request_id`` and tell the node (a no-op for a finished leg)."""
        if self._queues.pop(request_id, None) is not None:
            self._aborts.append(request_id)
            self._wake.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _write(self, call: StepsStream) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            while True:
                await self._wake.wait()
                self._wake.clear()
                if not (self._starts or self._aborts):
                    continue
                # Starts go out in commands of at most STEP_COMMAND_BYTES (one larger start goes
                # alone), so a command stays within the node's receive limit
                # (pdserve/rpc/limits.py); aborts go with the last one.
                while len(self._starts) > 1:
                    n = command_split(self._starts)
                    if n == len(self._starts):
                        break
                    starts = self._starts[:n]
                    del self._starts[:n]
                    await call.write(pb.StepCommand(start=starts))
                cmd = pb.StepCommand(start=self._starts, abort=self._aborts)
                self._starts, self._aborts = [], []
                await call.write(cmd)

    async def _run(self) -> None:
        writer: asyncio.Task[None] | None = None
        call: StepsStream | None = None
        err = status_error(grpc.StatusCode.UNAVAILABLE, "the node ended the Steps stream")
        try:
            call = await self._connect()
            writer = asyncio.get_running_loop().create_task(self._write(call), name="steps-writer")
            async for batch in call.batches():
                for d in batch.deltas:
                    q = self._queues.get(d.request_id)
                    if q is not None:
                        q.put_nowait(d)
                        if d.finish_reason:
                            del self._queues[d.request_id]
                for e in batch.ends:
                    q = self._queues.pop(e.request_id, None)
                    if q is not None:
                        trailing = ((KV_LOAD_FAILED_KEY, "1"),) if e.kv_load_failed else ()
                        q.put_nowait(
                            status_error(_CODES.get(e.code, grpc.StatusCode.UNKNOWN), e.details, trailing)
                        )
                if batch.HasField("stream_end"):  # the node ends the stream for all its legs
                    se = batch.stream_end
                    code = _CODES.get(se.code, grpc.StatusCode.UNKNOWN)
                    err = status_error(
                        grpc.StatusCode.UNAVAILABLE,
                        f"the node ended the Steps stream: {code.name}: {se.details}",
                    )
                    logger.error("node ended the Steps stream: %s %s", code.name, se.details)
                    break
        except grpc.aio.AioRpcError as e:
            err = e
        except asyncio.CancelledError:
            err = status_error(grpc.StatusCode.CANCELLED, "the router closed the Steps stream")
            raise
        finally:
            if writer is not None:
                writer.cancel()
            if call is not None:
                call.cancel()  # the socket is closed
            # No await from here on: a leg opened now must see a fresh stream, not this one.
            queues, self._queues = self._queues, {}
            self._starts, self._aborts = [], []
            for q in queues.values():
                q.put_nowait(err)
            if queues:
                logger.warning(
                    "Steps stream ended with %d legs open: %s %s", len(queues), err.code(), err.details()
                )
                if self._on_break is not None:
                    self._on_break(len(queues))
