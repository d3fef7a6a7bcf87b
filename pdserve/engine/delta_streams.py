"""Where a node's generation deltas go: EngineLoop's per-request streams and their delivery.

``DeltaStreams`` maps each request EngineLoop admitted (pdserve/engine/engine_loop.py) to the
place its deltas go: an ``on_delta`` callback run on the event loop in step order (a queue's
put_nowait for ``EngineLoop.generate``, or a consumer's callback for ``EngineLoop.admit``: one
Steps stream for many requests), and optionally a ``DirectSink`` (services/steps_direct.py)
that the engine thread writes the deltas it takes to itself, without waking the event loop.

The engine thread calls ``deliver`` with each step's deltas; the event loop drains what it was
handed (``_drain_outq``) and ends streams with an error delta (``end``, ``end_all``) when the
engine thread is stuck or dead.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from typing import Protocol

from pdserve.engine.outputs import GenerationDelta

logger = logging.getLogger(__name__)


class DirectSink(Protocol):
    """A stream whose deltas the engine thread writes itself (services/steps_direct.py)."""

    def takes(self, d: GenerationDelta) -> bool: ...

    def write(self, deltas: list[GenerationDelta]) -> list[GenerationDelta]: ...


class DeltaStreams:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        # request id -> where its deltas go, called on the event loop in step order: a queue's
        # put_nowait (generate) or a consumer's callback (start: one Steps stream for many)
        self.on_delta: dict[str, Callable[[GenerationDelta], None]] = {}
        # request id -> its stream's engine-thread writer (services/steps_direct.py): deltas it
        # takes go out from this thread, without waking the event loop; the finishing one is
        # also dispatched to ``on_delta`` (the consumer's bookkeeping, not a second write)
        self.direct: dict[str, DirectSink] = {}
        self._outq: collections.deque[list[GenerationDelta]] = collections.deque()  # engine -> loop
        self._wake_pending = False

    def __len__(self) -> int:
        """Requests whose deltas have a destination here (0 once every request ended)."""
        return len(self.on_delta) + len(self.direct)

    # -- called from the event loop ------------------------------------------------------------
    def add(
        self, request_id: str, on_delta: Callable[[GenerationDelta], None], direct: DirectSink | None
    ) -> None:
        self.on_delta[request_id] = on_delta
        if direct is not None:
            self.direct[request_id] = direct

    def discard(self, request_id: str) -> None:
        """Stop delivering ``request_id``'s deltas (a no-op for one not here)."""
        self.on_delta.pop(request_id, None)
        self.direct.pop(request_id, None)

    def end(self, request_id: str, message: str) -> None:
        """Hand ``request_id``'s stream, if still open, an error delta with ``message``."""
        sink = self.on_delta.get(request_id)
        if sink is not None:
            sink(_error_delta(request_id, message))

    def end_all(self, message: str) -> None:
        """Hand every open stream an error delta with ``message`` (the engine thread died)."""
        for rid, sink in list(self.on_delta.items()):
            sink(_error_delta(rid, message))

    # -- the engine thread ---------------------------------------------------------------------
    def deliver(self, deltas: list[GenerationDelta]) -> None:
        if self.direct:
            deltas = self._write_direct(deltas)
            if not deltas:
                return
        # One wake-up of the event loop per batch of steps, not per step: while a wake-up is
        # pending the engine only appends (each wake-up is a self-pipe write, whose syscall hands
        # the GIL to the event loop thread and cost the engine thread ~16% of its time at 16
        # streams in the profile, docs/benchmarks.md).
        self._outq.append(deltas)
        if self._wake_pending:
            return
        self._wake_pending = True
        try:
            self.loop.call_soon_threadsafe(self._drain_outq)
        except RuntimeError:  # the event loop is closed (shutdown): nobody is listening any more
            logger.debug("dropped %d deltas after the event loop closed", len(deltas))

    def _write_direct(self, deltas: list[GenerationDelta]) -> list[GenerationDelta]:
        """Engine thread: hand each direct stream its deltas of this step (one call per stream);
        returns what the event loop still gets (other streams' deltas, errors, the finishing ones)."""
        direct = self.direct
        rest: list[GenerationDelta] = []
        by_sink: dict[DirectSink, list[GenerationDelta]] = {}
        for d in deltas:
            sink = direct.get(d.request_id)
            if sink is None:
                rest.append(d)
            else:
                by_sink.setdefault(sink, []).append(d)
        for sink, ds in by_sink.items():
            try:
                rest.extend(sink.write(ds))
            except Exception:  # a writer's bug must not kill the engine thread or starve others
                logger.exception("writing %d deltas to a Steps socket failed", len(ds))
                rest.extend(d for d in ds if d.finish_reason is not None)  # their requests still end
        return rest

    # -- the event loop, woken by deliver ------------------------------------------------------
    def _drain_outq(self) -> None:
        self._wake_pending = False  # first: a batch appended from now on schedules a new drain
        while self._outq:
            self._dispatch(self._outq.popleft())

    def _dispatch(self, deltas: list[GenerationDelta]) -> None:
        streams = self.on_delta
        for d in deltas:
            sink = streams.get(d.request_id)
            if sink is not None:
                try:
                    sink(d)
                except Exception:  # one consumer's bug must not starve the others' deltas
                    logger.exception("delivering a delta of %s failed", d.request_id)


def _error_delta(request_id: str, message: str) -> GenerationDelta:
    return GenerationDelta(request_id=request_id, token_ids=[], text="", finish_reason="error", error=message)
