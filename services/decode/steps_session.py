"""One Steps stream on a decode / colocated node: the router's connection to the Steps socket
(services/steps_socket.py, through ``DecodeServicer.steps_session`` in services/decode/server.py)
carrying every decode leg the router has on this node. A task per request admits it
(services/decode/admission.py) and waits for its end; ends, refusals and error deltas go into
the stream's Outbox (services/decode/outbox.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from pdserve import tracing
from pdserve.engine.outputs import GenerationDelta
from pdserve.errors import PdserveError
from pdserve.rpc import channel
from pdserve.rpc import node_pb2 as pb
from services.decode.admission import Refusal, open_request
from services.decode.outbox import Outbox
from services.decode.trace_spans import trace_decode
from services.steps_direct import DirectSteps

if TYPE_CHECKING:
    from services.decode.server import DecodeNode


async def run_steps_session(
    node: DecodeNode, request_iterator: AsyncIterator[pb.StepCommand], direct: DirectSteps
) -> AsyncIterator[pb.StepBatch]:
    """One Steps stream: one router connection to the Steps socket (services/steps_socket.py),
    every decode leg the router has on this node.

    The engine thread writes the requests' token deltas to the connection itself
    (``direct``, services/steps_direct.py). Each request runs as a task whose ends, refusals
    and error deltas go into the outbox; this yields the outbox as one batch whenever the
    previous write is done. The stream ending (the router went away) cancels every request's
    task, which aborts it on the engine."""
    outbox = Outbox()
    tasks: dict[str, asyncio.Task[None]] = {}

    def admit(r: pb.DecodeRequest) -> None:
        rid = r.request_id
        gate = node.drain_gate
        if gate is not None and gate.draining:
            outbox.end(rid, grpc.StatusCode.UNAVAILABLE, "node is draining: Decode refused, use another")
            return
        if not rid or rid in tasks:
            outbox.end(rid, grpc.StatusCode.INVALID_ARGUMENT, f"request id {rid!r} is empty or in use")
            return
        task = asyncio.get_running_loop().create_task(
            _step_request(node, r, outbox, direct), name=f"step-{rid}"
        )
        tasks[rid] = task

        def done(_t: asyncio.Task[None], rid: str = rid) -> None:
            tasks.pop(rid, None)
            outbox.wake()

        task.add_done_callback(done)

    async def read() -> None:
        async for cmd in request_iterator:
            for r in cmd.start:
                admit(r)
            for rid in cmd.abort:
                t = tasks.get(rid)
                if t is not None:
                    t.cancel()

    reader = asyncio.get_running_loop().create_task(read(), name="steps-reader")
    try:
        while True:
            batch = await outbox.take(reader, lambda: reader.done() and not tasks)
            if batch is None:
                break
            yield batch
    finally:
        reader.cancel()
        pending = list(tasks.values())
        for t in pending:
            t.cancel()
        await asyncio.gather(reader, *pending, return_exceptions=True)


async def _step_request(
    node: DecodeNode, request: pb.DecodeRequest, outbox: Outbox, direct: DirectSteps
) -> None:
    """One request of a Steps stream: admit it; the engine thread writes its token deltas
    (``direct``) and hands the rest to the outbox (a callback per step, no task wake-up per
    step); this task only waits for the end. Cancelling it (router abort, stream gone)
    aborts the request."""
    rid = request.request_id
    times = [time.monotonic()]  # admitted, first delta (traces)
    gate = node.drain_gate
    if gate is not None:
        gate.active += 1
    try:
        try:
            adm = await open_request(node, request)
        except Refusal as r:
            outbox.end(rid, r.code, r.details)
            return
        loop = node.engine_loop
        assert loop is not None
        ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        interval = request.flush_interval_ms / 1000.0
        if interval > 0:
            direct.hold(rid, interval)  # merged on the engine thread, as Outbox would

        def on_delta(d: GenerationDelta) -> None:
            if ended.done():
                return
            if len(times) == 1:
                times.append(time.monotonic())
            if direct.takes(d):
                # the engine thread wrote it; only its end is this callback's (finishing deltas)
                if d.finish_reason is not None:
                    ended.set_result(None)
                return
            if d.finish_reason == "error" and d.overloaded:
                outbox.end(rid, grpc.StatusCode.RESOURCE_EXHAUSTED, d.error or "node is full")
            elif d.finish_reason == "error" and node.kv_consumer.wants_reprefill(rid):
                outbox.end(
                    rid,
                    grpc.StatusCode.ABORTED,
                    f"{d.error} (kv_load_failure_policy reprefill)",
                    kv_load_failed=True,
                )
            else:
                outbox.put(d, interval)
                if d.finish_reason is None:
                    return
            ended.set_result(None)

        try:
            await loop.admit(adm.prompt_token_ids, adm.params, rid, on_delta, direct=direct, **adm.kwargs)
        except PdserveError as e:
            outbox.end(rid, channel.error_to_status(e), str(e))
            return
        finished = False
        try:
            await ended
            finished = True
        finally:
            loop.release(rid, abort=not finished)
            if not finished:
                outbox.drop(rid)
            pull = node.pull_times.pop(rid, [])
            if request.traceparent and tracing.enabled():
                trace_decode(node, request, times, pull, finished)
    finally:
        # every exit drops the request's KV record: a refusal, a failed admit, the end, and a
        # cancellation while admitting (the router aborted or its stream went away)
        node.kv_consumer.forget(rid)
        direct.forget(rid)
        if gate is not None:
            gate.active -= 1
