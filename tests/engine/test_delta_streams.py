"""DeltaStreams: one event-loop wake-up per batch of steps, direct sinks written on the calling
thread, and a failing writer or consumer that neither loses a request's end nor starves others."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from pdserve.engine.delta_streams import DeltaStreams
from pdserve.engine.outputs import GenerationDelta


def delta(rid: str, tok: int, finish: str | None = None) -> GenerationDelta:
    return GenerationDelta(request_id=rid, token_ids=[tok], text="", finish_reason=finish)


class _CountingLoop:
    """The event loop, with its call_soon_threadsafe calls counted."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.wakeups = 0

    def call_soon_threadsafe(self, fn: Callable[..., Any], *args: Any) -> asyncio.Handle:
        self.wakeups += 1
        return self.loop.call_soon_threadsafe(fn, *args)


class _Sink:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.writes: list[tuple[str, list[GenerationDelta]]] = []

    def takes(self, d: GenerationDelta) -> bool:
        return True

    def write(self, deltas: list[GenerationDelta]) -> list[GenerationDelta]:
        if self.fail:
            raise OSError("peer gone")
        self.writes.append((threading.current_thread().name, deltas))
        return [d for d in deltas if d.finish_reason is not None]


def test_batches_of_steps_wake_the_loop_once_and_arrive_in_order() -> None:
    async def main() -> None:
        counting = _CountingLoop(asyncio.get_running_loop())
        streams = DeltaStreams(counting)  # type: ignore[arg-type]
        got: list[GenerationDelta] = []
        streams.add("a", got.append, None)
        for i in range(3):  # three steps before the event loop runs
            streams.deliver([delta("a", i), delta("gone", 9)])
        assert got == [] and counting.wakeups == 1
        await asyncio.sleep(0)
        assert [d.token_ids[0] for d in got] == [0, 1, 2]
        streams.deliver([delta("a", 3)])  # the drain ran: the next batch wakes the loop again
        await asyncio.sleep(0)
        assert counting.wakeups == 2 and got[-1].token_ids == [3]

    asyncio.run(main())


def test_direct_sinks_failing_writers_and_consumers() -> None:
    async def main() -> None:
        streams = DeltaStreams(asyncio.get_running_loop())
        good, bad = _Sink(), _Sink(fail=True)
        got: dict[str, list[GenerationDelta]] = {"d": [], "x": [], "q": []}

        def broken(d: GenerationDelta) -> None:
            raise RuntimeError("consumer bug")

        streams.add("d", got["d"].append, good)
        streams.add("x", got["x"].append, bad)
        streams.add("boom", broken, None)
        streams.add("q", got["q"].append, None)
        assert len(streams) == 6
        batch = [delta("d", 1), delta("x", 1), delta("boom", 1), delta("q", 1)]
        done = [delta("d", 2, "stop"), delta("x", 2, "stop"), delta("q", 2, "stop")]
        await asyncio.to_thread(streams.deliver, batch)
        await asyncio.to_thread(streams.deliver, done)
        await asyncio.sleep(0.01)
        # The direct sink got its tokens on the delivering thread; its consumer only the end.
        assert [d.token_ids for _, ds in good.writes for d in ds] == [[1], [2]]
        assert threading.main_thread().name not in {name for name, _ in good.writes}
        assert [d.finish_reason for d in got["d"]] == ["stop"]
        # A writer that raised: its requests still end; a consumer that raised starves nobody.
        assert [d.finish_reason for d in got["x"]] == ["stop"]
        assert [d.token_ids for d in got["q"]] == [[1], [2]]
        streams.discard("d")
        streams.discard("x")
        streams.end("q", "stuck")
        streams.end("d", "stuck")  # released: nothing to end
        assert got["q"][-1].finish_reason == "error" and got["q"][-1].error == "stuck"
        assert len(got["d"]) == 1 and len(streams) == 2
        streams.discard("boom")
        streams.end_all("died")
        assert got["q"][-1].error == "died" and len(streams) == 1

    asyncio.run(main())
