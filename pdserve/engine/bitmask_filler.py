"""BitmaskFiller: grammar bitmasks filled on a thread of their own, overlapping the engine
thread's host work. ``GrammarMasker`` (``grammar_masks``) owns one when asked to overlap and
hands it each step's fill (``structured.fill_bitmask``), in steady decode with the batched
accept of the step's tokens (``SteadyRows.take``) first; ``BitmaskFill.wait`` returns once the
bitmask is written, or raises what the thread raised.
"""

from __future__ import annotations

import queue
import sys
import threading
from typing import Any

from pdserve.engine.structured import GrammarState, _batch_accept, fill_bitmask

# The switch interval while a fill is under way (BitmaskFiller): 50 us, against CPython's 5 ms.
FILLER_SWITCH_INTERVAL_S = 5e-5


class BitmaskFill:
    """One fill handed to a BitmaskFiller; ``wait()`` returns once the bitmask is written."""

    def __init__(self, restore_switch_interval: float | None) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        # Set when the accept handed with the fill rejected a token (one bool per row): the
        # bitmask was not filled then, the submitter redoes the rows (GrammarMasker.wait).
        self.rejected: list[bool] | None = None
        self._restore = restore_switch_interval
        self._restore_lock = threading.Lock()

    def restore_switch_interval(self) -> None:
        """Put the interpreter's switch interval back (once, from whichever thread comes first)."""
        with self._restore_lock:
            restore, self._restore = self._restore, None
        if restore is not None:
            sys.setswitchinterval(restore)

    def wait(self, timeout_s: float) -> None:
        try:
            if not self._done.wait(timeout_s):
                raise TimeoutError(f"grammar bitmask fill not done within {timeout_s:g} s")
        finally:
            self.restore_switch_interval()  # the filler did already, unless the fill never ended
        if self._error is not None:
            raise self._error


class BitmaskFiller:
    """Fills grammar bitmasks on a thread of its own (``pdserve-grammar``), so a step's fill
    overlaps the engine thread's host work on the step before (detokenizing, building deltas).

    xgrammar's batched fill lets go of the GIL. The hand-offs still need it: the woken thread
    must take the GIL to start the fill and to report it done, while the engine thread runs
    plain Python that keeps it for the interpreter's switch interval (5 ms). From the submit to
    the fill's end the interval is lowered to ``switch_interval_s`` (the filler thread puts it
    back as soon as the fill is written), so each hand-off waits tens of microseconds, not
    milliseconds. Worth it with cores to spare: the model runner uses one on CUDA hosts of 4
    usable cores or more, under asynchronous scheduling (docs/benchmarks.md).
    """

    def __init__(self, switch_interval_s: float = FILLER_SWITCH_INTERVAL_S) -> None:
        self._jobs: queue.SimpleQueue[
            tuple[list[GrammarState], Any, tuple[list[Any], list[int]] | None, BitmaskFill] | None
        ] = queue.SimpleQueue()
        self._switch_interval_s = switch_interval_s
        self._thread = threading.Thread(target=self._run, name="pdserve-grammar", daemon=True)
        self._thread.start()

    def submit(
        self, states: list[GrammarState], bitmask: Any, accept: tuple[list[Any], list[int]] | None = None
    ) -> BitmaskFill:
        """Start filling ``bitmask`` for ``states`` (``fill_bitmask``), after the batched accept
        of ``accept`` (matchers, one token each: ``SteadyRows.take``'s) when given; xgrammar
        lets go of the GIL in both. Nothing may touch those matchers or that buffer until the
        returned fill's ``wait()`` returned."""
        old = sys.getswitchinterval()
        restore = None
        if old > self._switch_interval_s:
            sys.setswitchinterval(self._switch_interval_s)
            restore = old
        fill = BitmaskFill(restore)
        self._jobs.put((states, bitmask, accept, fill))
        return fill

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            states, bitmask, accept, fill = job
            del job
            try:
                rejected = _batch_accept(*accept) if accept is not None else None
                if rejected is None:
                    fill_bitmask(states, bitmask)
                else:
                    fill.rejected = rejected
            except BaseException as e:  # handed to the engine thread by wait()
                fill._error = e
            fill.restore_switch_interval()
            fill._done.set()
            del states, bitmask, accept, fill  # hold no buffer or matcher while idle

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)
