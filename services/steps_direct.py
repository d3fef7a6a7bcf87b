"""The engine thread writes a Steps stream's tokens to the stream's socket itself.

On the Steps socket (services/steps_socket.py) the node's side of each stream is the router's
TCP connection. Plain token deltas of that stream do not go through the node's event loop: after a step the engine thread builds the stream's ``StepBatch``,
serializes it and hands the frame to the socket (non-blocking). The event loop is not woken per
step, so it does not take the GIL from the engine thread once per step (the stall that cost the
served path 20-30% at low concurrency on CPU, docs/benchmarks.md, "The served path on CPU").

What still goes through the event loop: admission and refusals (``StepEnd``), error deltas
(overload, a failed KV load: their handling is the node's), and the finishing delta's
bookkeeping (the request's task ends, the engine loop releases it) -- the finishing delta itself
is written here, in step order with the request's other deltas. Non-streaming requests' flush
interval is kept here too (``DirectSteps.hold``).

The engine never waits for the router: what the socket does not take at once is kept, in
order, and the event loop writes it when the socket is writable again; while anything waits,
later frames queue behind it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from pdserve.engine.outputs import GenerationDelta, merge_deltas
from pdserve.rpc import channel, convert
from pdserve.rpc import node_pb2 as pb

logger = logging.getLogger(__name__)
# Bytes queued for a router connection that does not read (stopped, wedged) before the session is given
# up: its requests are aborted instead of the engine's frames piling up in memory.
MAX_PENDING_BYTES = 64 << 20


# A frame past this is a bug or an attack, not traffic: gRPC's own message limit (prompt_embeds).
MAX_FRAME = channel.MAX_MESSAGE_BYTES


def frame(data: bytes) -> bytes:
    """One frame of a Steps socket connection: a 4-byte big-endian length, then ``data``."""
    return len(data).to_bytes(4, "big") + data


class FrameTooLarge(ConnectionError):
    """A frame header announced more than the reader's limit (nothing of it was read)."""


async def read_frame(reader: asyncio.StreamReader, limit: int = MAX_FRAME) -> bytes | None:
    """The next frame's payload; None at a clean end of stream (EOF between frames). A frame
    over ``limit`` bytes raises FrameTooLarge; one cut short, ConnectionError."""
    try:
        head = await reader.readexactly(4)
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise ConnectionError("the Steps socket closed inside a frame header") from e
        return None
    n = int.from_bytes(head, "big")
    if n > limit:
        raise FrameTooLarge(f"a Steps frame of {n} bytes is over the {limit}-byte limit")
    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError as e:
        raise ConnectionError(
            f"the Steps socket closed inside a frame ({len(e.partial)} of {n} bytes)"
        ) from e


class SocketFrames:
    """Length-prefixed frames to one stream socket, from any thread, never blocking the caller.

    ``fd`` is the connection's socket; writes go through a duplicate of it (the asyncio
    transport keeps reading the original). A frame is either written whole in order or, once
    the socket failed, dropped (``closed``: the session's reader sees the connection end)."""

    def __init__(
        self,
        fd: int,
        loop: asyncio.AbstractEventLoop,
        on_fail: Callable[[], None] | None = None,
        max_pending: int = MAX_PENDING_BYTES,
    ) -> None:
        self._sock = socket.socket(fileno=os.dup(fd))
        self._sock.setblocking(False)
        self._loop = loop
        self._lock = threading.Lock()
        self._pending = bytearray()  # bytes the socket has not taken yet, in order
        self._watching = False  # the event loop waits for writability to flush _pending
        self._drained: asyncio.Event | None = None
        self.closed = False
        self._on_fail = on_fail  # called on the event loop once a write failed (the peer is gone)
        self._max_pending = max_pending

    @property
    def pending_bytes(self) -> int:
        return len(self._pending)

    def write(self, payload: bytes) -> None:
        data = frame(payload)
        with self._lock:
            if self.closed:
                return
            if not self._pending:
                try:
                    sent = self._sock.send(data)
                except BlockingIOError:
                    sent = 0
                except OSError as e:
                    self._fail(e)
                    return
                if sent == len(data):
                    return
                data = data[sent:]
            self._pending += data
            if len(self._pending) > self._max_pending:
                self._fail(OSError(f"the router read nothing while {len(self._pending)} bytes queued"))
                return
            if not self._watching:
                self._watching = True
                self._loop.call_soon_threadsafe(self._watch)

    def _fail(self, e: OSError) -> None:  # under the lock
        if self.closed:
            return
        logger.info("Steps socket write failed (the router went away?): %r", e)
        self.closed = True
        self._pending.clear()
        if self._on_fail is not None:
            try:
                self._loop.call_soon_threadsafe(self._on_fail)
            except RuntimeError:  # the event loop is closed: nobody left to tell
                pass

    # -- the event loop ----------------------------------------------------------------------------
    def _watch(self) -> None:
        if self.closed:
            return
        try:
            self._loop.add_writer(self._sock.fileno(), self._flush)
        except (OSError, ValueError) as e:
            with self._lock:
                self._fail(OSError(str(e)))

    def _flush(self) -> None:
        with self._lock:
            try:
                sent = self._sock.send(self._pending) if self._pending else 0
            except BlockingIOError:
                return
            except OSError as e:
                self._fail(e)
                sent = 0
            del self._pending[:sent]
            if self._pending and not self.closed:
                return
            self._watching = False
        self._loop.remove_writer(self._sock.fileno())
        if self._drained is not None:
            self._drained.set()

    async def drain(self, high_water: int = 1 << 20) -> None:
        """The event loop's own writes wait here while more than ``high_water`` bytes queue."""
        while len(self._pending) > high_water and not self.closed:
            self._drained = asyncio.Event()
            await self._drained.wait()
            self._drained = None

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._pending.clear()
            watching, self._watching = self._watching, False
        if watching:
            self._loop.remove_writer(self._sock.fileno())
        self._sock.close()


class DirectSteps:
    """One Steps stream's engine-thread sink (``EngineLoop.admit(..., direct=...)``).

    A request with a flush interval (``hold``: non-streaming, the router's
    ``nonstream_flush_ms``) has its first delta written at once, then its deltas merged and
    written at most once per interval and with its finish, as ``Outbox`` (services/decode/outbox.py) does on the event loop.
    There is always a next step while it runs, so no timer is needed. Per-request state lives on
    the engine thread; ``forget`` (event loop) only queues its removal."""

    def __init__(self, frames: SocketFrames) -> None:
        self.frames = frames
        self._intervals: dict[str, float] = {}  # request id -> flush interval (s), set before admission
        self._held: dict[str, GenerationDelta] = {}  # engine thread only
        self._sent_at: dict[str, float] = {}  # engine thread only
        self._forget: collections.deque[str] = collections.deque()

    @staticmethod
    def takes(d: GenerationDelta) -> bool:
        """Whether the engine thread writes ``d``: everything but an error delta, which the
        node's event loop turns into the right ``StepEnd`` (overload, KV load failure)."""
        return d.finish_reason != "error"

    def hold(self, request_id: str, interval_s: float) -> None:
        """Event loop, before the request is admitted: merge its deltas for ``interval_s``."""
        self._intervals[request_id] = interval_s

    def forget(self, request_id: str) -> None:
        """Event loop, once the request is over (finished or given up): drop its state."""
        self._forget.append(request_id)

    def write(self, deltas: list[GenerationDelta]) -> list[GenerationDelta]:
        """Engine thread: one step's deltas of this stream as (at most) one ``StepBatch`` frame.
        Returns what the event loop must still see: error deltas (not written; tokens held for
        their request are written first) and finishing deltas (written; for the bookkeeping)."""
        while self._forget:
            rid = self._forget.popleft()
            self._intervals.pop(rid, None)
            self._held.pop(rid, None)
            self._sent_at.pop(rid, None)
        now = time.monotonic()
        batch = pb.StepBatch()
        loop_side: list[GenerationDelta] = []
        for d in deltas:
            rid = d.request_id
            held = self._held.pop(rid, None)  # only held requests have one
            if not self.takes(d):
                if held is not None:
                    convert.add_delta_pb(batch.deltas, held)
                loop_side.append(d)
                continue
            if held is not None:
                d = merge_deltas(held, d)
            interval = self._intervals.get(rid)
            if interval is not None and d.finish_reason is None:
                sent = self._sent_at.get(rid)
                if sent is not None and now - sent < interval:
                    self._held[rid] = d
                    continue
                self._sent_at[rid] = now
            convert.add_delta_pb(batch.deltas, d)
            if d.finish_reason is not None:
                loop_side.append(d)
        if len(batch.deltas):
            self.frames.write(batch.SerializeToString())
        return loop_side
