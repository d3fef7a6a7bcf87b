"""The engine thread of EngineLoop (pdserve/engine/engine_loop.py): its commands, its loop, its death.

Every engine mutation happens on this thread. Other threads queue commands: ``call`` (a future
the caller awaits), ``post`` (fire-and-forget, an error logged: ``guarded``) and ``put`` (a
command as it is). The loop runs every queued command, then steps while a step can make
progress, hands each step's deltas to ``deliver``, and sleeps on the command queue when idle.
``busy_since`` says when its current step or command began (``EngineLoop.busy_s``, which the
node's watchdog reads).

If the loop itself fails, the thread logs it, sets ``dead``, fails every call not yet run with
``EngineDeadError`` and schedules ``after_death`` on the event loop (EngineLoop ends every
stream and tells the node).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from pdserve.distributed.workers import WorkerError
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import GenerationDelta
from pdserve.errors import EngineDeadError
from pdserve.kvtransfer.params import KVLoadSpec

logger = logging.getLogger(__name__)
T = TypeVar("T")

IDLE_WAIT_S = 0.05


class EngineThread:
    def __init__(
        self,
        engine: LLMEngine,
        loop: asyncio.AbstractEventLoop,
        deliver: Callable[[list[GenerationDelta]], None],  # this thread: deltas to their streams
        on_kv_loads: Callable[[list[KVLoadSpec]], None] | None,
        on_step: Callable[[LLMEngine], None] | None,
        after_death: Callable[[BaseException], None],  # runs on the event loop once this thread died
    ) -> None:
        self.engine = engine
        self.loop = loop
        self._deliver = deliver
        self._on_kv_loads = on_kv_loads
        self._on_step = on_step  # runs on the engine thread after each step (metrics, leases)
        self._after_death = after_death
        self._cmds: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._stopped = threading.Event()
        self.dead: BaseException | None = None
        self._pending: set[Future[Any]] = set()  # call() futures not yet run (failed on death)
        self._pending_lock = threading.Lock()
        # time.monotonic() when the engine thread's current step or command began; None: idle
        # (written by the engine thread, read by the node's watchdog on the event loop)
        self.busy_since: float | None = None
        self.last_step_start_s: float | None = None  # the last engine step's start (traces)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._cmds.put(None)
        self._thread.join(timeout=10)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # -- any thread --------------------------------------------------------------------------------
    def put(self, cmd: Callable[[], None]) -> None:
        """Queue ``cmd`` as it is (its error, if any, kills the thread: wrap what may raise)."""
        self._cmds.put(cmd)

    def call(self, fn: Callable[[LLMEngine], T], check_alive: Callable[[], None]) -> asyncio.Future[T]:
        """Run ``fn(engine)`` on the engine thread; await the result. ``check_alive`` runs first,
        under the lock a death takes to fail the calls not yet run.

        Cancelling the awaiting task cancels the future; the command then does nothing (setting
        a result on a cancelled future raised InvalidStateError and killed the thread)."""
        fut: Future[T] = Future()
        with self._pending_lock:  # checked under the lock: a death drains _pending under it too
            check_alive()
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
        self._cmds.put(lambda: self.guarded(fn))

    # -- the engine thread -----------------------------------------------------------------------
    def guarded(self, fn: Callable[[LLMEngine], T]) -> T | None:
        # A fire-and-forget command has no caller to hand its error to: log it with its trace
        # and keep the thread alive for every other request.
        try:
            return fn(self.engine)
        except Exception:
            logger.exception("engine command %r failed; the engine thread goes on", fn)
            return None

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
                self.busy_since = time.monotonic()
                cmd()
                self.busy_since = None
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    cmd = None
            if self._stopped.is_set():
                break
            if not eng.has_runnable():
                continue
            expired = self.guarded(lambda e: e.expire_queued())
            if expired:
                self._deliver(expired)
            self.busy_since = self.last_step_start_s = time.monotonic()
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
                self.busy_since = None
            loads = eng.take_kv_loads()
            if loads and self._on_kv_loads is not None:
                self._on_kv_loads(loads)
            if self._on_step is not None:
                self._on_step(eng)
            if deltas:
                self._deliver(deltas)
