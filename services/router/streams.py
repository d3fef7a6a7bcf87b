"""Running backend sequences: merge their deltas, time them, and stop them when the client goes.

Ownership: whoever iterates :func:`run_sequences` owns every backend generator it started. Leaving
the iteration early by any path (``aclose()``, cancellation of the consuming task, an exception)
cancels the pump tasks, which closes each backend generator, which aborts the request on the
nodes (``GenerateBackend.generate``'s contract).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pdserve.engine.detokenizer import DetokState, IncrementalDetokenizer
from pdserve.engine.outputs import GenerationDelta
from services.router.backend import BackendRequest, GenerateBackend
from services.router.metrics import RouterMetrics, observe_n

_DONE = object()
T = TypeVar("T")


class _SequenceTimer:
    """Per-sequence latency metrics; arrival is when the HTTP request reached the router."""

    def __init__(self, metrics: RouterMetrics, arrival_s: float, num_prompt_tokens: int) -> None:
        self.metrics = metrics
        self.arrival_s = arrival_s
        self.last_s: float | None = None
        metrics.prompt_tokens.inc(num_prompt_tokens)

    def on_delta(self, delta: GenerationDelta) -> None:
        now = time.monotonic()
        num_new = len(delta.token_ids)
        if num_new:
            if self.last_s is None:
                self.metrics.time_to_first_token.observe(now - self.arrival_s)
            else:
                observe_n(self.metrics.inter_token_latency, (now - self.last_s) / num_new, num_new)
            self.last_s = now
            self.metrics.generation_tokens.inc(num_new)
        if delta.finish_reason is not None:
            self.finish(delta.finish_reason)

    def finish(self, reason: str) -> None:
        self.metrics.e2e_request_latency.observe(time.monotonic() - self.arrival_s)
        self.metrics.request_success.labels(finished_reason=reason).inc()


def detokenize_here(detok: IncrementalDetokenizer | None, req: BackendRequest) -> DetokState | None:
    """Take ``req``'s detokenization off the node (its engine thread, where every microsecond
    of host work per token is a step's): the node sends token ids only and the router makes the
    text (docs/design.md §7). Not with stop strings: they are matched where the tokens are made, so the
    node can stop at once. Returns the sequence's state, or None (the node detokenizes)."""
    sp = req.sampling_params
    if detok is None or sp.stop or not sp.detokenize:
        return None
    req.sampling_params = dataclasses.replace(sp, detokenize=False)
    return detok.new_state([], sp.include_stop_str_in_output, sp.skip_special_tokens)


async def run_sequences(
    backend: GenerateBackend,
    reqs: list[BackendRequest],
    metrics: RouterMetrics,
    arrival_s: float,
    detok: IncrementalDetokenizer | None = None,
) -> AsyncGenerator[tuple[int, GenerationDelta], None]:
    """Yield ``(position in reqs, delta)`` as deltas arrive, interleaved, until all have finished.
    With ``detok``, the deltas' text is made here (``detokenize_here``)."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, req: BackendRequest) -> None:
        timer = _SequenceTimer(metrics, arrival_s, req.num_prompt_tokens)
        state = detokenize_here(detok, req)
        finished = False
        metrics.num_requests_running.inc()
        try:
            # aclosing: a generator left at a yield is closed here, not whenever GC gets to it.
            async with contextlib.aclosing(backend.generate(req)) as deltas:
                # Read to the generator's natural end rather than breaking at the finishing delta:
                # closing it early would look like a cancellation to the backend (an abort).
                async for delta in deltas:
                    assert not finished, f"{req.request_id}: delta after the finishing one"
                    if state is not None:
                        assert detok is not None
                        text = detok.append(state, delta.token_ids) if delta.token_ids else ""
                        if delta.finish_reason is not None:
                            text += detok.flush(state)
                        delta.text = text
                    timer.on_delta(delta)
                    queue.put_nowait((i, delta))
                    finished = delta.finish_reason is not None
        except Exception as e:  # the consumer re-raises it in its own task
            queue.put_nowait((i, e))
            return
        finally:
            metrics.num_requests_running.dec()
            if not finished:
                timer.finish("abort")
        if not finished:
            queue.put_nowait(
                (i, RuntimeError(f"backend stream of {req.request_id} ended without finish_reason"))
            )
        queue.put_nowait((i, _DONE))

    tasks = [asyncio.create_task(pump(i, r), name=f"pump-{r.request_id}") for i, r in enumerate(reqs)]
    try:
        num_running = len(tasks)
        while num_running:
            i, item = await queue.get()
            if item is _DONE:
                num_running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        # Wait so that every backend generator has run its cleanup (the abort) before we return.
        await asyncio.gather(*tasks, return_exceptions=True)


class ClientDisconnected(Exception):
    """The client went away before the answer was complete; nobody is left to answer."""


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ClientDisconnected.

    Once the request body has been read, ``receive()`` returns only when the client goes away.
    Plain asyncio tasks rather than an anyio task group: anyio re-cancels at every await inside a
    cancelled scope, which would cut short the backend generators' cleanup (the abort).
    """
    work_task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.create_task(wait_disconnect())
    try:
        await asyncio.wait({work_task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work_task.done():
            work_task.cancel()
        await asyncio.gather(work_task, watch, return_exceptions=True)
    if work_task.cancelled():
        raise ClientDisconnected
    return work_task.result()


class SSEResponse(StreamingResponse):
    """``text/event-stream`` that stops (and closes its iterator) as soon as the client leaves.

    Starlette's StreamingResponse watches for disconnects only on ASGI < 2.4; from 2.4 on it
    notices only when a write fails, which never happens while the backend stalls. We always
    watch, so a stalled sequence is aborted on the nodes as soon as its client is gone.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await until_disconnect(receive, self.stream_response(send))
        except ClientDisconnected:
            pass
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def sse_event(data: str) -> str:
    return f"data: {data}\n\n"
