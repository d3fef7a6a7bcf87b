"""Drives one LLMEngine from a dedicated thread for asyncio services.

Every engine mutation happens on the engine thread: callers post commands (add, abort, any
function of the engine) and receive deltas on per-request asyncio queues. The thread steps
while there is work and sleeps on its command queue when idle (engine/engine_thread.py); each
step's deltas go to their requests' streams (engine/delta_streams.py).

The thread must not die silently (docs/design.md §7): a command whose caller was cancelled is a no-op,
a command that raises is logged and the loop goes on, and if the loop itself fails every stream
ends with an error delta at once, every later call raises ``EngineDeadError``, and ``on_death``
tells the node (which turns NOT_SERVING and exits non-zero).

The thread must not hang silently either: ``busy_s()`` says how long its current step or
command has run, and the node's watchdog (services/engine_watchdog.py) takes the node out of service while
that exceeds ``step_timeout_s`` (``fail_streams`` ends the streams from the event loop).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any, TypeVar

from pdserve.engine.delta_streams import DeltaStreams, DirectSink
from pdserve.engine.engine_thread import EngineThread
from pdserve.engine.grammar_spec import check_size
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import GenerationDelta, merge_deltas
from pdserve.engine.request import MultiModalItem
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import EngineDeadError, EngineWedgedError
from pdserve.kvtransfer.params import KVLoadSpec, KVTransferParams

T = TypeVar("T")


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        loop: asyncio.AbstractEventLoop,
        on_kv_loads: Callable[[list[KVLoadSpec]], None] | None = None,
        on_step: Callable[[LLMEngine], None] | None = None,
        on_death: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.engine = engine
        self.loop = loop
        # Pulls start from inside the step, as soon as their blocks are allocated (LLMEngine).
        engine.kv_loads.sink = on_kv_loads
        self._streams = DeltaStreams(loop)  # request id -> where its deltas go (delta_streams.py)
        self._thread = EngineThread(
            engine, loop, self._streams.deliver, on_kv_loads, on_step, self._after_death
        )
        self._on_death = on_death  # runs on the event loop once the engine thread has died
        # Set by the node's watchdog while the current step is past step_timeout_s: calls are
        # refused (EngineWedgedError) instead of queueing behind the stuck step.
        self.wedged: str | None = None
        engine.grammar_admission.wake = self._wake_engine  # a grammar compiled: admit its request now

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._thread.stop()

    # -- called from the event loop ------------------------------------------------------------
    @property
    def num_streams(self) -> int:
        """Requests whose deltas have a destination here (0 once every request ended)."""
        return len(self._streams)

    @property
    def dead(self) -> BaseException | None:
        """What killed the engine thread (None while it runs)."""
        return self._thread.dead

    @property
    def alive(self) -> bool:
        return self.dead is None

    @property
    def last_step_start_s(self) -> float | None:
        """time.monotonic() at the last engine step's start (traces)."""
        return self._thread.last_step_start_s

    def busy_s(self, now: float | None = None) -> float:
        """How long the engine thread's current step or command has run (0 when idle)."""
        since = self._thread.busy_since
        return 0.0 if since is None else (time.monotonic() if now is None else now) - since

    def fail_streams(self, message: str) -> list[str]:
        """Event loop: end every open stream now with an error delta (the engine thread may be
        stuck and cannot), and abort their requests on the engine once it runs again. Returns
        their request ids."""
        ids = list(self._streams.on_delta)
        for rid in ids:
            self._streams.end(rid, message)
            self.release(rid, abort=True)
        return ids

    def _wake_engine(self) -> None:
        """Any thread: wake an idle engine thread (a no-op command)."""
        self._thread.put(lambda: None)

    def check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"the engine thread died ({self.dead!r}); this node is restarting")
        if self.wedged is not None:
            raise EngineWedgedError(self.wedged)

    def call(self, fn: Callable[[LLMEngine], T]) -> asyncio.Future[T]:
        """Run ``fn(engine)`` on the engine thread; await the result (a cancelled caller's
        command does nothing: EngineThread.call)."""
        return self._thread.call(fn, self.check_alive)

    def post(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Fire-and-forget variant of :meth:`call` (safe from any thread)."""
        self._thread.post(fn)

    def post_and_dispatch(self, fn: Callable[[LLMEngine], list[GenerationDelta]]) -> None:
        """Run ``fn(engine)`` on the engine thread and deliver the deltas it returns (any thread)."""

        def run() -> None:
            deltas = self._thread.guarded(fn)
            if deltas:
                self._streams.deliver(deltas)

        self._thread.put(run)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        kv_transfer_params: KVTransferParams | None = None,
        output_token_ids: list[int] | None = None,
        priority: int = 0,
        prompt_embeds: Any | None = None,
        mm_items: Sequence[MultiModalItem] = (),
        lora_name: str = "",
    ) -> AsyncGenerator[GenerationDelta, None]:
        """Admit a request and yield its deltas; closing the generator aborts the request."""
        q: asyncio.Queue[GenerationDelta] = asyncio.Queue()
        await self.admit(
            prompt_token_ids,
            params,
            request_id,
            q.put_nowait,
            kv_transfer_params=kv_transfer_params,
            output_token_ids=output_token_ids,
            priority=priority,
            prompt_embeds=prompt_embeds,
            mm_items=mm_items,
            lora_name=lora_name,
        )
        finished = False
        try:
            while True:
                d = await q.get()
                # Everything this stream's steps made while its reader was busy, as one delta:
                # a slow reader gets larger deltas, never a waiting engine (the queue is unbounded).
                while d.finish_reason is None and not q.empty():
                    d = merge_deltas(d, q.get_nowait())
                yield d
                if d.finish_reason is not None:
                    finished = True
                    return
        finally:
            self.release(request_id, abort=not finished)

    async def admit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        on_delta: Callable[[GenerationDelta], None],
        *,
        kv_transfer_params: KVTransferParams | None = None,
        output_token_ids: list[int] | None = None,
        priority: int = 0,
        prompt_embeds: Any | None = None,
        mm_items: Sequence[MultiModalItem] = (),
        direct: DirectSink | None = None,
        lora_name: str = "",
    ) -> None:
        """Admit a request whose deltas go to ``on_delta`` (on the event loop, in order, the last
        one with a finish_reason); returns once it is admitted, raises if refused.

        The per-request consumer without a task or a queue: a Steps stream calls this
        for all its requests, so a step costs the event loop one callback per request. The caller
        must :meth:`release` the request: after its finishing delta, or with ``abort=True``
        when it gives up on it."""
        self.check_alive()
        if params.structured is not None:
            # Admitted once its grammar is compiled (off this loop and the engine thread): a
            # compile that fails or runs out of time is this request's error (InvalidRequestError:
            # INVALID_ARGUMENT, the router's 400), never a stream that ends in an error.
            # shield: a caller that leaves must not cancel a Future other requests share
            kind, spec = params.structured
            check_size(spec, self.engine.config.max_grammar_bytes, "the node's max_grammar_bytes")
            await asyncio.shield(asyncio.wrap_future(self.engine.grammar_service().submit(kind, spec)))
            self.check_alive()
        self._streams.add(request_id, on_delta, direct)
        try:
            await self.call(
                lambda e: e.add_request(
                    prompt_token_ids,
                    params,
                    request_id,
                    priority=priority,
                    kv_transfer_params=kv_transfer_params,
                    output_token_ids=output_token_ids,
                    prompt_embeds=prompt_embeds,
                    mm_items=mm_items,
                    lora_name=lora_name,
                )
            )
        except asyncio.CancelledError:
            # The caller left while add_request ran (or was queued): the request may be admitted
            # now with nobody to read it, so abort it (a no-op if it never got in).
            self._streams.discard(request_id)
            if self.dead is None:
                self.post(lambda e: e.abort([request_id]))
            raise
        except BaseException:
            self._streams.discard(request_id)  # refused: never abort, the id may be another's
            raise

    def release(self, request_id: str, *, abort: bool) -> None:
        """Stop delivering ``request_id``'s deltas; ``abort`` also ends it on the engine (a no-op
        for a request that already finished there)."""
        self._streams.discard(request_id)
        if abort and self.dead is None:
            self.post(lambda e: e.abort([request_id]))

    def _after_death(self, e: BaseException) -> None:
        """Event loop: end every open stream with an error now, then tell the node."""
        message = f"the engine thread of this node died ({type(e).__name__}: {e}); retry elsewhere"
        self._streams.end_all(message)
        if self._on_death is not None:
            self._on_death(e)
