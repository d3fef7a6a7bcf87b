"""The router's node choice and conditional disaggregation (no nodes needed: pure decisions)."""

from __future__ import annotations

import asyncio
import random

import pytest

from pdserve.engine.block_pool import hash_prompt_blocks
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import CapacityError
from services.router.backend import BackendRequest
from services.router.pd_backend import PDBackend, RouterPolicy


def _backend(policy: str = "least_loaded", **kw) -> PDBackend:
    # Channels are lazy: nothing listens on these ports and nothing is dialled here.
    return PDBackend(
        [("p0", "127.0.0.1:1"), ("p1", "127.0.0.1:2"), ("p2", "127.0.0.1:3")],
        [("d0", "127.0.0.1:4")],
        RouterPolicy(policy=policy, **kw),
    )


def _with_backend(fn, policy: str = "least_loaded", **kw):
    async def run():
        be = _backend(policy, **kw)
        try:
            return fn(be)
        finally:
            await be.close()

    return asyncio.run(run())


def test_least_loaded_prefers_healthy_and_idle() -> None:
    def check(be: PDBackend) -> None:
        p0, p1, p2 = be.prefill
        for n, load, healthy in ((p0, 5, True), (p1, 1, True), (p2, 0, False)):
            n.reported_load, n.healthy = load, healthy
        assert be.pick(be.prefill, None).name == "p1"  # p2 is idler but unreachable
        p1.in_flight = 10
        assert be.pick(be.prefill, None).name == "p0"
        assert be.pick(be.prefill, None, {"p0", "p1"}).name == "p2"  # only the unhealthy one left
        with pytest.raises(CapacityError):
            be.pick(be.prefill, None, {"p0", "p1", "p2"})

    _with_backend(check)


def test_prefix_affinity_is_sticky_and_spreads() -> None:
    def check(be: PDBackend) -> dict[str, int]:
        for n in be.prefill:
            n.healthy = True
        rng = random.Random(0)
        counts = {"p0": 0, "p1": 0, "p2": 0}
        for _ in range(60):
            key = hash_prompt_blocks([rng.randrange(500) for _ in range(64)], 16)[-1]
            first = be.pick(be.prefill, key).name
            assert all(be.pick(be.prefill, key).name == first for _ in range(3))
            counts[first] += 1
            # The owner gone: the key moves, the others stay put (rendezvous hashing).
            assert be.pick(be.prefill, key, {first}).name != first
        return counts

    counts = _with_backend(check, "prefix_affinity")
    assert all(c >= 8 for c in counts.values()), counts


def test_round_robin_cycles() -> None:
    def check(be: PDBackend) -> list[str]:
        for n in be.prefill:
            n.healthy = True
        return [be.pick(be.prefill, None).name for _ in range(6)]

    names = _with_backend(check, "round_robin")
    assert sorted(names[:3]) == ["p0", "p1", "p2"] and names[:3] == names[3:]


def test_conditional_disaggregation() -> None:
    def check(be: PDBackend) -> None:
        d0 = be.decode[0]
        sp = SamplingParams()
        short = BackendRequest("a", list(range(10)), sp)
        long_ids = list(range(100, 164))
        long = BackendRequest("b", long_ids, sp)
        hashes = hash_prompt_blocks(long_ids, 16)
        assert be.prefill_locally(short, hash_prompt_blocks(short.prompt_token_ids, 16), d0)
        assert not be.prefill_locally(long, hashes, d0)
        for h in hashes[:2]:
            d0.remember_prefix(h)
        assert not be.prefill_locally(long, hashes, d0)  # half seen: still disaggregated
        for h in hashes:
            d0.remember_prefix(h)
        assert be.prefill_locally(long, hashes, d0)  # the decode node has it all cached

    _with_backend(check, local_prefill_max_tokens=32)
