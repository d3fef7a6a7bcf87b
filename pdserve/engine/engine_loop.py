"""Drives one LLMEngine from a dedicated thread for asyncio services.

Every engine mutation happens on the engine thread: callers post commands (add, abort, any
function of the engine) and receive deltas on per-request asyncio queues. The thread steps
while there is work and sleeps on its command queue when idle.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import GenerationDelta
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler_output import KVLoadSpec
from pdserve.kvtransfer.params import KVTransferParams

logger = logging.getLogger(__name__)
T = TypeVar("T")
IDLE_WAIT_S = 0.05


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        loop: asyncio.AbstractEventLoop,
        on_kv_loads: Callable[[list[KVLoadSpec]], None] | None = None,
        on_step: Callable[[LLMEngine], None] | None = None,
    ) -> None:
        self.engine = engine
        self.loop = loop
        self._on_kv_loads = on_kv_loads
        self._on_step = on_step  # runs on the engine thread after each step (metrics, leases)
        self._cmds: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[GenerationDelta]] = {}
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._stopped = threading.Event()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._cmds.put(None)
        self._thread.join(timeout=10)

    # -- called from the event loop ------------------------------------------------------------
    def call(self, fn: Callable[[LLMEngine], T]) -> asyncio.Future[T]:
        """Run ``fn(engine)`` on the engine thread; await the result."""
        fut: Future[T] = Future()

        def run() -> None:
            try:
                fut.set_result(fn(self.engine))
            except BaseException as e:  # handed to the awaiting caller, not swallowed
                fut.set_exception(e)

        self._cmds.put(run)
        return asyncio.wrap_future(fut, loop=self.loop)

    def post(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Fire-and-forget variant of :meth:`call` (safe from any thread)."""
        self._cmds.put(lambda: fn(self.engine))

    def post_and_dispatch(self, fn: Callable[[LLMEngine], list[GenerationDelta]]) -> None:
        """Run ``fn(engine)`` on the engine thread and deliver the deltas it returns (any thread)."""

        def run() -> None:
            deltas = fn(self.engine)
            if deltas:
                self.loop.call_soon_threadsafe(self._dispatch, deltas)

        self._cmds.put(run)

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
    ) -> AsyncGenerator[GenerationDelta, None]:
        """Admit a request and yield its deltas; closing the generator aborts the request."""
        q: asyncio.Queue[GenerationDelta] = asyncio.Queue()
        self._streams[request_id] = q
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
                )
            )
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        finished = False
        try:
            while True:
                d = await q.get()
                yield d
                if d.finish_reason is not None:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.post(lambda e: e.abort([request_id]))

    # -- the engine thread -----------------------------------------------------------------------
    def _dispatch(self, deltas: list[GenerationDelta]) -> None:
        for d in deltas:
            q = self._streams.get(d.request_id)
            if q is not None:
                q.put_nowait(d)

    def _run(self) -> None:
        eng = self.engine
        while not self._stopped.is_set():
            # Sleep on the command queue unless a step can make progress: requests waiting only
            # for remote KV, or a step that could schedule nothing, wait for an event (a finished
            # pull, a new request, an abort) instead of spinning against the pull for the CPU.
            block = not eng.has_runnable() or eng.last_step_empty
            try:
                cmd = self._cmds.get(timeout=IDLE_WAIT_S) if block else self._cmds.get_nowait()
            except queue.Empty:
                cmd = None
                if block and self._on_step is not None:
                    self._on_step(eng)  # idle tick: leases, deferred frees
            while cmd is not None:
                cmd()
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    cmd = None
            if self._stopped.is_set():
                break
            if not eng.has_runnable():
                continue
            try:
                deltas = eng.step()
            except Exception:
                logger.exception("engine step failed; failing every request in flight")
                deltas = eng.fail_all("engine step failed (see the node's log)")
            loads = eng.take_kv_loads()
            if loads and self._on_kv_loads is not None:
                self._on_kv_loads(loads)
            if self._on_step is not None:
                self._on_step(eng)
            if deltas:
                self.loop.call_soon_threadsafe(self._dispatch, deltas)
