"""services/router/metrics.py: observe_n is n observations, bucket for bucket."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from services.router.metrics import observe_n

BUCKETS = (0.01, 0.025, 0.05, 0.1, 1.0)


def _hist() -> tuple[CollectorRegistry, Histogram]:
    reg = CollectorRegistry()
    return reg, Histogram("x_seconds", "d", buckets=BUCKETS, registry=reg)


def _samples(reg: CollectorRegistry) -> list[str]:
    return [
        ln
        for ln in generate_latest(reg).decode().splitlines()
        if not ln.startswith(("#", "x_seconds_created"))
    ]


@pytest.mark.parametrize(
    "obs",
    [
        [(0.004, 5)],
        [(0.01, 3), (0.0100001, 2)],  # on a bound, and just past it
        [(0.3, 1), (7.5, 4), (0.02, 0)],  # past every bound (+Inf), and no tokens
        [(0.05, 1), (0.001, 13), (0.2, 2)],
    ],
)
def test_observe_n_equals_n_observations(obs: list[tuple[float, int]]) -> None:
    reg_a, looped = _hist()
    reg_b, batched = _hist()
    for amount, n in obs:
        for _ in range(n):
            looped.observe(amount)
        observe_n(batched, amount, n)
    a, b = _samples(reg_a), _samples(reg_b)
    assert a == b
    count = next(ln for ln in b if ln.startswith("x_seconds_count"))
    assert float(count.split()[1]) == sum(n for _, n in obs)
