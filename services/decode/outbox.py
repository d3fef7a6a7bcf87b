"""What one Steps stream of a decode or colocated node has not sent yet (``Outbox``).

``run_steps_session`` (services/decode/steps_session.py) puts each request's deltas and
ends here on the event loop and its writer takes them as one ``StepBatch`` whenever the previous
write is done; requests with a flush interval are held and merged here. Deltas the engine thread
writes to a socket itself (services/steps_direct.py) do not come here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from pdserve.engine.outputs import GenerationDelta, merge_deltas
from pdserve.rpc import convert
from pdserve.rpc import node_pb2 as pb


class Outbox:
    """What one Steps stream has not sent yet: per request its merged delta, then the ends.

    A request with a flush interval (``DecodeRequest.flush_interval_ms``) has its deltas held
    here and merged until the interval has passed or it finishes."""

    def __init__(self) -> None:
        self._deltas: dict[str, GenerationDelta] = {}
        self._ends: list[pb.StepEnd] = []
        # The writer's wait: one future, resolved by the first put / end / wake (and by the reader
        # task ending) -- not an Event plus asyncio.wait, which made a task per empty wait.
        self._waiter: asyncio.Future[None] | None = None
        self._held: dict[str, GenerationDelta] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._started: set[str] = set()  # held requests whose first delta was sent

    def put(self, d: GenerationDelta, interval_s: float = 0.0) -> None:
        rid = d.request_id
        held = self._held.pop(rid, None)
        if held is not None:
            d = merge_deltas(held, d)
        if interval_s > 0 and d.finish_reason is None and rid in self._started:
            self._held[rid] = d
            if rid not in self._timers:
                self._timers[rid] = asyncio.get_running_loop().call_later(interval_s, self._flush, rid)
            return
        if d.finish_reason is None:
            if interval_s > 0:
                self._started.add(rid)  # its first tokens went at once (the time to first token)
        else:
            self._started.discard(rid)
        timer = self._timers.pop(rid, None)
        if timer is not None:
            timer.cancel()
        prev = self._deltas.get(rid)
        self._deltas[rid] = d if prev is None else merge_deltas(prev, d)
        self.wake()

    def _flush(self, rid: str) -> None:
        self._timers.pop(rid, None)
        held = self._held.pop(rid, None)
        if held is not None:
            prev = self._deltas.get(rid)
            self._deltas[rid] = held if prev is None else merge_deltas(prev, held)
            self.wake()

    def drop(self, rid: str) -> None:
        """A request the router gave up on: what was held for it is not sent."""
        self._held.pop(rid, None)
        self._started.discard(rid)
        timer = self._timers.pop(rid, None)
        if timer is not None:
            timer.cancel()

    def end(self, rid: str, code: grpc.StatusCode, details: str, *, kv_load_failed: bool = False) -> None:
        self._flush(rid)  # tokens held for it go first, as the deltas of a batch precede its ends
        self._started.discard(rid)
        self._ends.append(
            pb.StepEnd(request_id=rid, code=code.value[0], details=details, kv_load_failed=kv_load_failed)
        )
        self.wake()

    def wake(self, _task: object = None) -> None:
        """Resolve the writer's wait (also the reader task's done callback: ``_task``)."""
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def take(self, reader: asyncio.Task[None], done: Callable[[], bool]) -> pb.StepBatch | None:
        """The next batch; None once ``done()`` (the router closed its side, no request left)."""
        while not (self._deltas or self._ends):
            if done():
                return None
            # Once the reader has ended (the router half-closed), only a request's delta, end or
            # finishing task (wake) can change done(): wait for those, no spinning on the reader.
            self._waiter = asyncio.get_running_loop().create_future()
            watch = not reader.done()
            if watch:
                reader.add_done_callback(self.wake)
            try:
                await self._waiter
            finally:
                if watch:
                    reader.remove_done_callback(self.wake)
                self._waiter = None
        deltas, self._deltas = self._deltas, {}
        ends, self._ends = self._ends, []
        batch = pb.StepBatch(ends=ends)
        for d in deltas.values():
            convert.add_delta_pb(batch.deltas, d)
        return batch
