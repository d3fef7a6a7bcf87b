"""A prefill call's spans (pdserve/tracing.py), made from times noted on the way: the engine thread
only stores a time.monotonic() reading in a dict.

    prefill                call -> answer              (child of the router's prefill leg)
      prefill.queue        call -> first engine step that ran the prompt
      prefill.compute      that step's start -> answer  (the prompt's steps, the first token)
    prefill.kv_held        answer -> the decode node's pull served (child of prefill; the KV held
                           for the transfer: bytes pushed, pull wait)

The first step is found after each step (``PrefillTraces.after_step``): the first one that began
after the call and after which the request has computed tokens or has left the scheduler. A step
that began between the call and the engine's taking the request in may be named: the split is
exact to one step.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from pdserve import tracing

MAX_WATCHED = 4096  # requests whose spans are being noted (oldest dropped past it)


class PrefillTraces:
    def __init__(self) -> None:
        # transfer id -> [call time, first step's start or None]
        self._calls: OrderedDict[str, list[float | None]] = OrderedDict()
        # transfer id -> (prefill span, KV held since) until the pull is served
        self._held: OrderedDict[str, tuple[Any, float]] = OrderedDict()
        # transfer id -> (bytes, push seconds, end) of a pull served before its answer went out
        # (an early pull: the decode leg opened with the prefill leg)
        self._early: OrderedDict[str, tuple[int, float, float]] = OrderedDict()

    def begin(self, tid: str, t_call: float) -> None:
        self._calls[tid] = [t_call, None]
        while len(self._calls) > MAX_WATCHED:  # calls that ended without an answer
            self._calls.popitem(last=False)

    def after_step(self, engine: Any, step_start_s: float | None) -> None:
        """Engine thread, after a step that began at ``step_start_s``."""
        if not self._calls or step_start_s is None:
            return
        requests = engine.scheduler.requests
        for tid, noted in list(self._calls.items()):
            if noted[1] is not None or noted[0] is None or step_start_s < noted[0]:
                continue
            req = requests.get(tid)
            if req is None or req.num_computed_tokens > 0:
                noted[1] = step_start_s

    def end(self, tid: str, parent: Any, attrs: dict[str, Any], held: bool) -> None:
        """The answer: ``prefill`` and its queue / compute children; the hold starts now."""
        t_call, t_first = self._calls.pop(tid, [None, None])
        if t_call is None:
            return
        now = time.monotonic()
        span = tracing.record("prefill", parent, t_call, now, **attrs)
        t_first = min(t_first if t_first is not None else t_call, now)
        tracing.record("prefill.queue", span, t_call, t_first)
        tracing.record("prefill.compute", span, t_first, now)
        early = self._early.pop(tid, None)
        if early is not None:  # pushed as soon as it was held: a hold of no length
            self._record_held(span, tid, now, now, early[0], early[1])
        elif held:
            self._held[tid] = (span, now)
            while len(self._held) > MAX_WATCHED:
                self._held.popitem(last=False)

    def pulled(self, tid: str, num_bytes: int, push_s: float) -> None:
        """A decode node's pull of ``tid`` was served (event loop)."""
        now = time.monotonic()
        got = self._held.pop(tid, None)
        if got is not None:
            self._record_held(got[0], tid, got[1], now, num_bytes, push_s)
        elif tid in self._calls:
            self._early[tid] = (num_bytes, push_s, now)
            while len(self._early) > MAX_WATCHED:
                self._early.popitem(last=False)

    @staticmethod
    def _record_held(
        span: Any, tid: str, start_s: float, end_s: float, num_bytes: int, push_s: float
    ) -> None:
        tracing.record(
            "prefill.kv_held",
            span,
            min(start_s, end_s),
            end_s,
            **{"pdserve.kv_bytes": num_bytes, "pdserve.kv_push_seconds": push_s, "pdserve.transfer_id": tid},
        )
