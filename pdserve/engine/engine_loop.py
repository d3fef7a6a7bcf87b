"""Drives one LLMEngine from a dedicated thread for asyncio services.

Every engine mutation happens on the engine thread: callers post commands (add, abort, any
function of the engine) and receive deltas on per-request asyncio queues. The thread steps
while there is work and sleeps on its command queue when idle.

The thread must not die silently (docs/design.md §7): a command whose caller was cancelled is a no-op,
a command that raises is logged and the loop goes on, and if the loop itself fails every stream
ends with an error delta at once, every later call raises ``EngineDeadError``, and ``on_death``
tells the node (which turns NOT_SERVING and exits non-zero).

The thread must not hang silently either: ``busy_s()`` says how long its current step or
command has run, and the node's watchdog (services/node.py) takes the node out of service while
that exceeds ``step_timeout_s`` (``fail_streams`` ends the streams from the event loop).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

from pdserve.distributed.workers import WorkerError
from pdserve.engine.grammar_spec import check_size
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import GenerationDelta, merge_deltas
from pdserve.engine.request import MultiModalItem
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import EngineDeadError, EngineWedgedError
from pdserve.kvtransfer.params import KVLoadSpec, KVTransferParams

logger = logging.getLogger(__name__)
T = TypeVar("T")


class DirectSink(Protocol):
    """A stream whose deltas the engine thread writes itself (services/steps_direct.py)."""

    def takes(self, d: GenerationDelta) -> bool: ...

    def write(self, deltas: list[GenerationDelta]) -> list[GenerationDelta]: ...


IDLE_WAIT_S = 0.05


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
        self._on_kv_loads = on_kv_loads
        # Pulls start from inside the step, as soon as their blocks are allocated (LLMEngine).
        engine.kv_loads.sink = on_kv_loads
        self._on_step = on_step  # runs on the engine thread after each step (metrics, leases)
        self._cmds: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        # request id -> where its deltas go, called on the event loop in step order: a queue's
        # put_nowait (generate) or a consumer's callback (start: one Steps stream for many)
        self._streams: dict[str, Callable[[GenerationDelta], None]] = {}
        # request id -> its stream's engine-thread writer (services/steps_direct.py): deltas it
        # takes go out from this thread, without waking the event loop; the finishing one is
        # also dispatched to ``_streams`` (the consumer's bookkeeping, not a second write)
        self._direct: dict[str, DirectSink] = {}
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._stopped = threading.Event()
        self._on_death = on_death  # runs on the event loop once the engine thread has died
        self.dead: BaseException | None = None
        self._pending: set[Future[Any]] = set()  # call() futures not yet run (failed on death)
        self._pending_lock = threading.Lock()
        self._outq: collections.deque[list[GenerationDelta]] = collections.deque()  # engine -> loop
        self._wake_pending = False
        # time.monotonic() when the engine thread's current step or command began; None: idle
        # (written by the engine thread, read by the node's watchdog on the event loop)
        self._busy_since: float | None = None
        self.last_step_start_s: float | None = None  # the last engine step's start (traces)
        # Set by the node's watchdog while the current step is past step_timeout_s: calls are
        # refused (EngineWedgedError) instead of queueing behind the stuck step.
        self.wedged: str | None = None
        engine.grammar_admission.wake = self._wake_engine  # a grammar compiled: admit its request now

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._cmds.put(None)
        self._thread.join(timeout=10)

    # -- called from the event loop ------------------------------------------------------------
    @property
    def num_streams(self) -> int:
        """Requests whose deltas have a destination here (0 once every request ended)."""
        return len(self._streams) + len(self._direct)

    @property
    def alive(self) -> bool:
        return self.dead is None

    def busy_s(self, now: float | None = None) -> float:
        """How long the engine thread's current step or command has run (0 when idle)."""
        since = self._busy_since
        return 0.0 if since is None else (time.monotonic() if now is None else now) - since

    def fail_streams(self, message: str) -> list[str]:
        """Event loop: end every open stream now with an error delta (the engine thread may be
        stuck and cannot), and abort their requests on the engine once it runs again. Returns
        their request ids."""
        ids = list(self._streams)
        for rid in ids:
            sink = self._streams.get(rid)
            if sink is not None:
                sink(
                    GenerationDelta(
                        request_id=rid, token_ids=[], text="", finish_reason="error", error=message
                    )
                )
            self.release(rid, abort=True)
        return ids

    def _wake_engine(self) -> None:
        """Any thread: wake an idle engine thread (a no-op command)."""
        self._cmds.put(lambda: None)

    def check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"the engine thread died ({self.dead!r}); this node is restarting")
        if self.wedged is not None:
            raise EngineWedgedError(self.wedged)

    def call(self, fn: Callable[[LLMEngine], T]) -> asyncio.Future[T]:
        """Run ``fn(engine)`` on the engine thread; await the result.

        Cancelling the awaiting task cancels the future; the command then does nothing (setting
        a result on a cancelled future raised InvalidStateError and killed the thread)."""
        fut: Future[T] = Future()
        with self._pending_lock:  # checked under the lock: a death drains _pending under it too
            self.check_alive()
            self._pending.add(fut)

        def run() -> None:
            with self._pending_lock:
                self._pending.discard(fut)
            if not fut.set_running_or_notify_cancel():
                return  # the caller is gone: skip the work too (an add for a gone caller)
            try:
                result = fn(self.engine)
            except BaseException as e:  # handed to the awaiting caller, not swallowed
                fut.set_exception(e)
            else:
                fut.set_result(result)

        self._cmds.put(run)
        return asyncio.wrap_future(fut, loop=self.loop)

    def post(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Fire-and-forget variant of :meth:`call` (safe from any thread)."""
        self._cmds.put(lambda: self._guarded(fn))

    def post_and_dispatch(self, fn: Callable[[LLMEngine], list[GenerationDelta]]) -> None:
        """Run ``fn(engine)`` on the engine thread and deliver the deltas it returns (any thread)."""

        def run() -> None:
            deltas = self._guarded(fn)
            if deltas:
                self._deliver(deltas)

        self._cmds.put(run)

    def _guarded(self, fn: Callable[[LLMEngine], T]) -> T | None:
        # A fire-and-forget command has no caller to hand its error to: log it with its trace
        # and keep the thread alive for every other request.
        try:
            return fn(self.engine)
        except Exception:
            logger.exception("engine command %r failed; the engine thread goes on", fn)
            return None

    def _deliver(self, deltas: list[GenerationDelta]) -> None:
        if self._direct:
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
        direct = self._direct
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

    def _drain_outq(self) -> None:
        self._wake_pending = False  # first: a batch appended from now on schedules a new drain
        while self._outq:
            self._dispatch(self._outq.popleft())

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
        self._streams[request_id] = on_delta
        if direct is not None:
            self._direct[request_id] = direct
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
            self._streams.pop(request_id, None)
            self._direct.pop(request_id, None)
            if self.dead is None:
                self.post(lambda e: e.abort([request_id]))
            raise
        except BaseException:
            self._streams.pop(request_id, None)  # refused: never abort, the id may be another's
            self._direct.pop(request_id, None)
            raise

    def release(self, request_id: str, *, abort: bool) -> None:
        """Stop delivering ``request_id``'s deltas; ``abort`` also ends it on the engine (a no-op
        for a request that already finished there)."""
        self._streams.pop(request_id, None)
        self._direct.pop(request_id, None)
        if abort and self.dead is None:
            self.post(lambda e: e.abort([request_id]))

    # -- the engine thread -----------------------------------------------------------------------
    def _dispatch(self, deltas: list[GenerationDelta]) -> None:
        streams = self._streams
        for d in deltas:
            sink = streams.get(d.request_id)
            if sink is not None:
                try:
                    sink(d)
                except Exception:  # one consumer's bug must not starve the others' deltas
                    logger.exception("delivering a delta of %s failed", d.request_id)

    def _run(self) -> None:
        try:
            self._loop_body()
        except BaseException as e:  # the thread is dying: make it loud and fail everyone now
            logger.critical("engine thread died: %r", e, exc_info=True)
            self.dead = e
            self._fail_pending(e)
            try:
                self.loop.call_soon_threadsafe(self._after_death, e)
            except RuntimeError:
                logger.error("event loop closed; cannot report the engine's death")

    def _fail_pending(self, e: BaseException) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, set()
        for fut in pending:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineDeadError(f"the engine thread died ({e!r})"))

    def _after_death(self, e: BaseException) -> None:
        """Event loop: end every open stream with an error now, then tell the node."""
        message = f"the engine thread of this node died ({type(e).__name__}: {e}); retry elsewhere"
        for rid, sink in list(self._streams.items()):
            sink(GenerationDelta(request_id=rid, token_ids=[], text="", finish_reason="error", error=message))
        if self._on_death is not None:
            self._on_death(e)

    def _loop_body(self) -> None:
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
                self._busy_since = time.monotonic()
                cmd()
                self._busy_since = None
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    cmd = None
            if self._stopped.is_set():
                break
            if not eng.has_runnable():
                continue
            expired = self._guarded(lambda e: e.expire_queued())
            if expired:
                self._deliver(expired)
            self._busy_since = self.last_step_start_s = time.monotonic()
            try:
                deltas = eng.step()
            except WorkerError as e:  # a TP rank or pipeline stage died: say so (first line only)
                logger.exception("engine step failed; failing every request in flight")
                reason = str(e).splitlines()[0]
                deltas = eng.fail_all(f"engine step failed, node out of service: {reason}")
            except Exception:
                logger.exception("engine step failed; failing every request in flight")
                deltas = eng.fail_all("engine step failed (see the node's log)")
            finally:
                self._busy_since = None
            loads = eng.take_kv_loads()
            if loads and self._on_kv_loads is not None:
                self._on_kv_loads(loads)
            if self._on_step is not None:
                self._on_step(eng)
            if deltas:
                self._deliver(deltas)
