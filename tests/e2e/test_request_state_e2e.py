"""Per-request state returns to zero on prefill and decode (real router, prefill, decode).

The memory a node keeps per request lives in maps keyed by request or transfer id (scheduler,
output processor, KV manager, seeded generators, engine-loop streams, the KV producer and its
lease tracker, the KV consumer's transfer records and pulls). Each node exports their sizes as
``pdserve:request_state_entries{map=...}``: after batches of finished, seeded and cancelled
requests every one must be back at 0, and the map set must not change. Counting entries, not
RSS: a leaked entry shows exactly, on any host load.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.e2e.lifecycle_helpers import wait_nothing_held

pytestmark = pytest.mark.slow
NODES = ["prefill-0", "decode-0"]
WORDS = "servers move caches between nodes while the quick brown fox jumps".split()


@pytest.fixture(scope="module")
def cluster(shared_pd_cluster):
    # tests/e2e/conftest.py: prompts of 60 words run disaggregated (local_prefill_max_tokens 16)
    return shared_pd_cluster


def state_entries(rc, name: str) -> dict[str, float]:
    text = httpx.get(f"http://{rc.node(name).metrics_address}/metrics", timeout=5).text
    out = {}
    for ln in text.splitlines():
        if ln.startswith("pdserve:request_state_entries{"):
            out[ln.split('map="')[1].split('"')[0]] = float(ln.split()[-1])
    return out


def wait_all_zero(rc, timeout_s: float = 10.0) -> dict[str, dict[str, float]]:
    t0 = time.monotonic()
    while True:
        state = {n: state_entries(rc, n) for n in NODES}
        if all(v == 0 for s in state.values() for v in s.values()):
            return state
        if time.monotonic() - t0 > timeout_s:
            left = {n: {k: v for k, v in s.items() if v} for n, s in state.items()}
            raise AssertionError(f"per-request entries left after {timeout_s} s: {left}")
        time.sleep(0.1)


async def _one(c: openai.AsyncOpenAI, rc, i: int) -> None:
    stream = await c.completions.create(
        model=rc.model_name,
        prompt=" ".join(WORDS[(i + j) % len(WORDS)] for j in range(4 if i % 3 == 0 else 60)),
        max_tokens=6 + i % 5,
        stream=True,
        temperature=0.8,
        seed=i if i % 2 else None,  # seeded requests keep a generator on the node
        extra_body={"ignore_eos": True},
    )
    async for _ in stream:
        pass


async def _hang_up(rc, i: int, delay_s: float) -> None:
    body = {
        "model": rc.model_name,
        "prompt": "the clients hang up early " * 24,
        "max_tokens": 64,
        "stream": True,
        "ignore_eos": True,
        "seed": i,
    }
    async with httpx.AsyncClient(timeout=30) as h:
        try:
            async with asyncio.timeout(delay_s):
                async with h.stream("POST", rc.base_url + "/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        pass
        except TimeoutError:
            pass


async def _batch(rc, n: int) -> None:
    c = openai.AsyncOpenAI(base_url=rc.base_url, api_key="x", max_retries=0, timeout=60)
    try:
        cancelled = [_hang_up(rc, i, (0.01, 0.05, 0.2)[i % 3]) for i in range(n // 4)]
        await asyncio.gather(*(_one(c, rc, i) for i in range(n)), *cancelled)
    finally:
        await c.close()


def test_per_request_maps_are_empty_after_batches(cluster) -> None:
    before = {n: state_entries(cluster, n) for n in NODES}
    # every map is exported, prefill's transfer tables and the KV consumer's among them
    assert {"scheduler.requests", "engine_loop.streams", "model_runner.generators"} <= set(
        before["prefill-0"]
    )
    assert {"kv_producer.transfers", "kv_send_tracker.entries"} <= set(before["prefill-0"])
    assert {"kv_consumer.pulls", "kv_consumer.transfers", "kv_cache_manager.requests"} <= set(
        before["decode-0"]
    )
    aborted0 = sum(cluster.load(n).num_aborted_total for n in NODES)
    for _ in range(3):
        asyncio.run(_batch(cluster, 24))
        wait_nothing_held(cluster, NODES, timeout_s=10)
        after = wait_all_zero(cluster)
        assert {n: set(s) for n, s in after.items()} == {n: set(s) for n, s in before.items()}
    assert sum(cluster.load(n).num_aborted_total for n in NODES) > aborted0  # hang-ups reached a node
    # the long prompts went through prefill's transfer tables (disaggregated), not only local
    text = httpx.get(f"http://{cluster.node('prefill-0').metrics_address}/metrics", timeout=5).text
    assert any(
        ln.startswith("pdserve:kv_transfers_total{") and float(ln.split()[-1]) > 0 for ln in text.splitlines()
    )
