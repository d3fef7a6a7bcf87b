"""Circuit breaker: out of rotation after node faults, half-open probe, 4xx are not faults."""

from __future__ import annotations

import grpc

from services.router.breaker import BreakerState, CircuitBreaker, is_node_fault


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_opens_after_threshold_then_half_open_probe() -> None:
    clk = Clock()
    b = CircuitBreaker(failure_threshold=2, open_s=5.0, clock=clk)
    b.record_failure()
    assert b.available() and b.state is BreakerState.CLOSED
    b.record_failure()
    assert not b.available() and b.state is BreakerState.OPEN
    clk.t = 4.9
    assert not b.available()
    clk.t = 5.0
    assert b.available() and b.state is BreakerState.HALF_OPEN
    b.on_dispatch()
    assert not b.available()  # one probe at a time
    b.record_failure()  # probe failed: open again, for another open_s
    assert b.state is BreakerState.OPEN and not b.available()
    clk.t = 10.0
    assert b.available()
    b.on_dispatch()
    b.record_success()
    assert b.state is BreakerState.CLOSED and b.available() and b.opened_total == 2


def test_success_resets_the_count_and_trip_opens_at_once() -> None:
    b = CircuitBreaker(failure_threshold=3, open_s=1.0, clock=Clock())
    b.record_failure()
    b.record_failure()
    b.record_success()
    b.record_failure()
    b.record_failure()
    assert b.available()
    b.trip()
    assert not b.available()
    b.reset()
    assert b.available()


def test_only_node_faults_count() -> None:
    assert is_node_fault(grpc.StatusCode.UNAVAILABLE) and is_node_fault(grpc.StatusCode.DEADLINE_EXCEEDED)
    for code in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,  # 429: the node is busy, not broken
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.NOT_FOUND,
    ):
        assert not is_node_fault(code)
