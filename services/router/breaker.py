"""A circuit breaker per node: a failing node leaves the rotation, a probe brings it back.

    CLOSED --(failures in a row >= threshold)--> OPEN --(open_s passed)--> HALF_OPEN
    HALF_OPEN: one request (the probe) goes to the node; success -> CLOSED, failure -> OPEN again

Only node faults count (the node is down, frozen, its engine died, it broke a stream): a 4xx,
a 429 / RESOURCE_EXHAUSTED, a client's cancel or a bad request say nothing about the node.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

import grpc

# gRPC codes that say the node (not the request) is at fault.
NODE_FAULT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DATA_LOSS,
    }
)


def is_node_fault(code: grpc.StatusCode) -> bool:
    return code in NODE_FAULT_CODES


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(
        self, failure_threshold: int = 3, open_s: float = 5.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if failure_threshold < 1 or open_s <= 0:
            raise ValueError(
                f"breaker needs failure_threshold >= 1 and open_s > 0, got {failure_threshold}, {open_s}"
            )
        self.failure_threshold = failure_threshold
        self.open_s = open_s
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probe_in_flight = False
        self.opened_total = 0

    @property
    def state(self) -> BreakerState:
        if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self.open_s:
            return BreakerState.HALF_OPEN
        return self._state

    def available(self) -> bool:
        """May a request be sent now? (No side effect: ``on_dispatch`` claims the probe.)"""
        st = self.state
        return st is BreakerState.CLOSED or (st is BreakerState.HALF_OPEN and not self._probe_in_flight)

    def on_dispatch(self) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self._state = BreakerState.HALF_OPEN
            self._probe_in_flight = True

    def record_success(self) -> None:
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._probe_in_flight = False

    def record_failure(self) -> None:
        self._failures += 1
        if self._state is BreakerState.HALF_OPEN or self._failures >= self.failure_threshold:
            if self._state is not BreakerState.OPEN:
                self.opened_total += 1
            self._state = BreakerState.OPEN
            self._opened_at = self._clock()
            self._probe_in_flight = False

    def trip(self) -> None:
        """Open at once (the node said it is down: health NOT_SERVING, GetLoad UNAVAILABLE)."""
        self._failures = self.failure_threshold
        self.record_failure()

    def reset(self) -> None:
        """A new epoch: the node restarted, its past failures say nothing about the new process."""
        self.record_success()
