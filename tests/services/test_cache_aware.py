"""cache_aware node choice over a prefix index, per-role round-robin, and the dashboard's state
(a PDBackend whose channels are never dialled; the index filled as KV events would)."""

from __future__ import annotations

import httpx

from pdserve.engine.block_pool import hash_prompt_blocks
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvevents.index import OFFLOAD, PrefixIndex
from services.router.backend import BackendRequest
from services.router.cache_aware import RouteKey
from services.router.dashboard import fleet_state
from services.router.pd_backend import PDBackend
from tests.services.test_pd_backend_policy import _with_backend
from tests.services.test_router_api import FakeBackend, backend, server_factory, tokenizer

__all__ = ["backend", "server_factory", "tokenizer"]  # fixtures used here


def _ready(be: PDBackend) -> PrefixIndex:
    for n in be.prefill + be.decode:
        n.healthy = True
    be.prefix_index = PrefixIndex()
    return be.prefix_index


def test_prefill_node_by_held_blocks_against_load() -> None:
    hashes = hash_prompt_blocks(list(range(160)), 16)  # 10 blocks

    def check(be: PDBackend) -> list[str]:
        index = _ready(be)
        for h in hashes[:6]:
            index.add("p1", h)
        for h in hashes[:2]:
            index.add("p2", h)
        key = RouteKey(hashes[3], hashes)
        picks = [be.pick(be.prefill, key).name]  # p1 holds the most
        be.prefill[1].in_flight = 1  # 8 blocks' worth of load outweighs its 4 more blocks
        picks.append(be.pick(be.prefill, key).name)
        be.prefill[1].in_flight = 0
        be.prefill[1].reported_load, be.prefill[1].in_flight_at_report = 1, 1  # its own, finished since
        picks.append(be.pick(be.prefill, key).name)
        return picks

    assert _with_backend(check, "cache_aware") == ["p1", "p2", "p1"]


def test_a_follow_up_prefills_on_the_decode_node_holding_its_history() -> None:
    history = list(range(100, 180))  # 5 blocks held on d0 after the last turn
    prompt = history + list(range(500, 512))

    def check(be: PDBackend) -> tuple[bool, bool]:
        index = _ready(be)
        d0 = be.decode[0]
        for h in hash_prompt_blocks(history, 16):
            index.add("d0", h)
        req = BackendRequest("r", prompt, SamplingParams())
        hashes = hash_prompt_blocks(prompt, 16)
        follow_up = be.prefill_locally(req, hashes, d0)  # 12 + 0 new tokens < 32
        index.clear_node("d0")
        return follow_up, be.prefill_locally(req, hashes, d0)

    assert _with_backend(check, "cache_aware", local_prefill_max_tokens=32) == (True, False)


def test_round_robin_turns_per_role() -> None:
    def check(be: PDBackend) -> list[str]:
        _ready(be)
        # a request picks a decode node, then a prefill node: each list keeps its own turn
        return [n for _ in range(3) for n in (be.pick(be.decode, None).name, be.pick(be.prefill, None).name)]

    assert _with_backend(check, "round_robin") == ["d0", "p0", "d0", "p1", "d0", "p2"]


def test_dashboard_state_and_page(server_factory) -> None:
    def state(be: PDBackend) -> dict:
        index = _ready(be)
        index.add("p0", b"x" * 16)
        be.decode[0].kv_blocks_used, be.decode[0].num_blocks_total = 3, 10
        be.decode[0].prefix_cache_queried_blocks, be.decode[0].prefix_cache_hit_blocks = 8, 6
        be.decode[0].transfers_in_flight = 2
        be.count_leg_failure("decode", "UNAVAILABLE")
        return fleet_state(be)

    s = _with_backend(state, "cache_aware")
    by_name = {n["name"]: n for n in s["nodes"]}
    assert s["policy"] == "cache_aware" and set(by_name) == {"p0", "p1", "p2", "d0"}
    assert by_name["d0"]["kv_blocks_used"] == 3 and by_name["d0"]["kv_blocks_total"] == 10
    assert by_name["p0"]["prefix_index_blocks"] == 1 and by_name["p0"]["in_rotation"]
    assert by_name["d0"]["prefix_hit_rate"] == 0.75 and by_name["d0"]["transfers_in_flight"] == 2
    assert by_name["p0"]["prefix_hit_rate"] is None  # no lookup reported yet
    assert [(e["role"], e["code"]) for e in s["recent_errors"]] == [("decode", "UNAVAILABLE")]

    server = server_factory(FakeBackend(), api_key="k")
    assert "pdserve fleet" in httpx.get(server.url + "/dashboard", timeout=10).text
    assert httpx.get(server.url + "/dashboard/state", timeout=10).status_code == 401
    got = httpx.get(server.url + "/dashboard/state", headers={"Authorization": "Bearer k"}, timeout=10)
    assert got.status_code == 200 and got.json()["nodes"] == []


def test_new_prompts_spread_over_an_idle_fleet() -> None:
    def check(be: PDBackend) -> list[str]:
        index = _ready(be)
        picks = []
        for i in range(3):
            hashes = hash_prompt_blocks(list(range(1000 * i, 1000 * i + 64)), 16)
            p = be.pick(be.prefill, RouteKey(hashes[3], hashes))
            for h in hashes:  # what its KV events would then say
                index.add(p.name, h)
            picks.append(p.name)
        return picks

    assert sorted(_with_backend(check, "cache_aware")) == ["p0", "p1", "p2"]


def test_least_loaded_counts_the_routers_own_sequences_once() -> None:
    def check(be: PDBackend) -> str:
        _ready(be)
        p0, p1, p2 = be.prefill
        p0.in_flight, p0.reported_load, p0.in_flight_at_report = 2, 2, 2  # its report holds our 2
        p1.in_flight, p1.reported_load, p1.in_flight_at_report = 0, 3, 0  # 3 of another router's
        p2.healthy = False
        assert p0.load == 2 and p1.load == 3
        return be.pick(be.prefill, None).name

    assert _with_backend(check) == "p0"  # counted twice (4) it lost to p1


def test_cache_aware_hashes_at_each_nodes_block_size_and_weighs_offload_hits() -> None:
    prompt = list(range(64))

    def check(be: PDBackend) -> list[str]:
        index = _ready(be)
        be.prefill[2].block_size = 32  # p2 hashes its blocks at 32 tokens
        for h in hash_prompt_blocks(prompt, 32):  # 2 blocks = the whole prompt, on p2's device
            index.add("p2", h)
        for h in hash_prompt_blocks(prompt, 16)[:3]:  # 3 of 4 blocks, p0's offload tier only
            index.add("p0", h, OFFLOAD)
        hashes = hash_prompt_blocks(prompt, 16)
        key = RouteKey(hashes[3], hashes, prompt, 16)
        picks = [be.pick(be.prefill, key).name]
        index.clear_node("p2")
        picks.append(be.pick(be.prefill, key).name)  # 1.5 blocks' worth beats p1's nothing
        return picks

    assert _with_backend(check, "cache_aware") == ["p2", "p0"]


def test_index_metrics_are_in_metrics_with_router_workers(tmp_path, monkeypatch) -> None:
    """With router workers /metrics reads the workers' files: the prefix index's collector (no
    file of its own) joins them as the answering worker's view."""
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from services.router.app import _exposed
    from services.router.cache_aware import KVEventsCollector
    from services.router.metrics import RouterMetrics

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    index = PrefixIndex()
    index.add("d0", b"h" * 16)
    metrics = RouterMetrics()
    metrics.add_process_collector(
        KVEventsCollector(SimpleNamespace(index=index, num_events=5, num_gaps=1, num_resyncs=1))  # type: ignore[arg-type]
    )
    text = generate_latest(_exposed(metrics)).decode()
    assert 'pdserve:router_prefix_index_blocks{node="d0"} 1.0' in text
    assert "pdserve:router_kv_events_total 5.0" in text
