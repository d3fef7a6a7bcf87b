"""A fleet with KV events (real node processes, a real redis-server): cache-aware routing against
round-robin on multi-turn conversations, measured by the nodes' prefix-cache counters, the
dashboard's per-node state, and a killed prefill node leaving the router's index and its rotation
within the registry TTL. The default run starts one 1 + 1 cluster for all of its checks."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from bench.fleet_workload import (
    Conversation,
    PieceIds,
    fleet_cluster,
    hit_blocks,
    ideal_hit_blocks,
    multi_turn,
    node_counters,
    run_turn,
    run_workload,
)
from pdserve.models.loader import load_tokenizer
from tests.e2e.cluster import RunningCluster, running_cluster
from tests.e2e.trace_collector import TraceCollector, check_trace_tree
from tests.registry.redis_proc import RedisProcess

BS = 16  # the nodes' block size (the default)
FULL = pytest.mark.skipif(
    not os.environ.get("PDSERVE_FULL_TESTS"),
    reason="2 prefill + 2 decode nodes, twice, 64 requests each (~100 s on 2 cores): PDSERVE_FULL_TESTS=1",
)


def _client(rc: RunningCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=rc.base_url, api_key="unused", max_retries=0)


def _index_blocks(rc: RunningCluster) -> dict[str, float]:
    with urllib.request.urlopen(rc.cluster.router_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(
            r'^pdserve:router_prefix_index_blocks\{node="([^"]+)"\} ([0-9.e+]+)$', text, re.M
        )
    }


def _hit_rate(
    rc: RunningCluster, model_dir: Path, convs: list[Conversation], seed: int, max_tokens: int
) -> float:
    """Prefix-cache hits on all nodes over the workload / every follow-up hitting its history."""
    before = node_counters(rc.cluster)
    pieces = PieceIds(load_tokenizer(model_dir))
    run_workload(_client(rc), rc.model_name, convs, max_tokens, pieces, seed, think_s=0.3)
    return hit_blocks(before, node_counters(rc.cluster)) / ideal_hit_blocks(convs, BS)


def _dashboard_state(rc: RunningCluster) -> dict[str, dict[str, Any]]:
    with urllib.request.urlopen(rc.cluster.router_url + "/dashboard/state", timeout=5) as r:
        return {n["name"]: n for n in json.loads(r.read())["nodes"]}


def test_cache_aware_follow_ups_traces_and_a_killed_prefill_node(
    tiny_models: dict[str, Path], redis_proc: RedisProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1 prefill + 1 decode (one cluster start for every check): one request's trace spans
    router, prefill, transfer and decode; follow-ups hit their history (>= 0.9 of ideal), say
    where they went, and show on the dashboard as the nodes' prefix-hit rates; a SIGKILLed prefill
    node leaves the index within the registry TTL and gets no request after (the decode node
    prefills). The 2 + 2 matrix and the choice between prefill nodes: PDSERVE_FULL_TESTS."""
    model_dir = tiny_models["llama"]
    collector = TraceCollector().start(monkeypatch)
    cluster = fleet_cluster(str(model_dir), redis_proc.url, "cache_aware", 1, 1, 24000, registry_ttl_s=1.0)
    with running_cluster(cluster, tmp_path) as rc, contextlib.closing(collector):
        client = _client(rc)
        first = client.completions.create(
            model=rc.model_name, prompt=list(range(20, 60)), max_tokens=4, temperature=0
        )
        check_trace_tree(collector.trace_of(first.id), "prefill-0")

        convs = multi_turn(2, 3, first_len=40, turn_len=12, seed=1)
        assert _hit_rate(rc, model_dir, convs, seed=2, max_tokens=16) >= 0.9
        for c in convs:
            assert c.routes[0]["x-pdserve-path"] == "disaggregated"  # 40 tokens, nothing cached
            assert c.routes[0]["x-pdserve-prefill-node"] == "prefill-0"
            for r in c.routes[1:]:  # the decode node holds the history: no prefill leg, no transfer
                assert r["x-pdserve-path"] == "local"
                assert int(r["x-pdserve-decode-prefix-hit-tokens"]) >= 3 * BS  # 40 + 16 - 1 held
        blocks = _index_blocks(rc)
        assert blocks.get("decode-0", 0) > 0 and blocks.get("prefill-0", 0) > 0
        t0 = time.monotonic()
        while not (_dashboard_state(rc)["decode-0"]["prefix_hit_rate"] or 0) > 0.3:  # the follow-ups' hits
            assert time.monotonic() - t0 < 5.0, "the nodes' counters did not reach the router"
            time.sleep(0.1)  # the router polls GetLoad every 0.5 s
        state = _dashboard_state(rc)
        assert state["prefill-0"]["prefix_hit_rate"] is not None
        assert state["decode-0"]["transfers_in_flight"] == 0 == state["prefill-0"]["transfers_in_flight"]

        victim = rc.children[[n.name for n in cluster.nodes].index("prefill-0")]
        os.killpg(victim.proc.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        while "prefill-0" in _index_blocks(rc):
            assert time.monotonic() - t_kill < cluster.registry_ttl_s + 2.0, "index kept the dead node"
            time.sleep(0.1)
        conv = multi_turn(1, 1, first_len=40, turn_len=12, seed=3)[0]
        run_turn(client, rc.model_name, conv, 0, 4, PieceIds(load_tokenizer(model_dir)))
        assert conv.routes[0]["x-pdserve-path"] == "local"  # no prefill node left: decode prefills
        assert "x-pdserve-prefill-node" not in conv.routes[0]


def _chromium(*args: str) -> str:
    """Headless Chromium (Debian's package) on the router's /dashboard; its stdout."""
    cmd = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=4000", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout


def _dashboard_rows(dom: str) -> dict[str, list[str]]:
    """node name -> its row's cells, from the page's DOM."""
    rows = {}
    for m in re.finditer(r'<tr id="node-([^"]+)">(.*?)</tr>', dom, re.S):
        rows[m.group(1)] = [
            re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td[^>]*>(.*?)</td>", m.group(2), re.S)
        ]
    return rows


def _check_dashboard(rc: RunningCluster, model_dir: Path, out_dir: Path) -> None:
    """The page shows both decode nodes with their KV usage, and a new request changes what it shows."""
    url = rc.cluster.router_url + "/dashboard"
    before = _dashboard_rows(_chromium("--dump-dom", url))
    assert {"decode-0", "decode-1", "prefill-0", "prefill-1"} <= set(before), before
    for name in ("decode-0", "decode-1"):
        assert re.fullmatch(r"\d+ / \d+", before[name][5]), before[name]  # KV blocks used / total
        assert int(before[name][5].split(" / ")[1]) > 0
    conv = multi_turn(1, 1, first_len=64, turn_len=12, seed=9)[0]
    run_turn(_client(rc), rc.model_name, conv, 0, 4, PieceIds(load_tokenizer(model_dir)))
    time.sleep(0.5)  # the nodes' KV events reach the router's index
    after = _dashboard_rows(_chromium("--dump-dom", url))
    assert after != before  # the prefix blocks indexed column moved
    _chromium(f"--screenshot={out_dir / 'dashboard.png'}", "--window-size=1100,420", url)
    assert (out_dir / "dashboard.png").stat().st_size > 1000


def _kill_prefill_node(rc: RunningCluster, model_dir: Path) -> None:
    """prefill-1 SIGKILLed: it leaves the index within the registry TTL, and new prompts all
    prefill on prefill-0."""
    victim = rc.children[[n.name for n in rc.cluster.nodes].index("prefill-1")]
    os.killpg(victim.proc.pid, signal.SIGKILL)
    t_kill = time.monotonic()
    while "prefill-1" in _index_blocks(rc):
        assert time.monotonic() - t_kill < rc.cluster.registry_ttl_s + 2.0, "index kept the dead node"
        time.sleep(0.1)
    pieces = PieceIds(load_tokenizer(model_dir))
    for conv in multi_turn(4, 1, first_len=40, turn_len=12, seed=3):
        run_turn(_client(rc), rc.model_name, conv, 0, 4, pieces)
        assert conv.routes[0]["x-pdserve-prefill-node"] == "prefill-0"


@FULL
def test_cache_aware_against_round_robin_two_by_two(
    tiny_models: dict[str, Path], redis_proc: RedisProcess, tmp_path: Path
) -> None:
    """2 prefill + 2 decode, 16 conversations x 4 turns: prefix hits >= 0.9 of ideal routed
    cache-aware, <= 0.55 round-robin; the same tokens either way; the dashboard in headless
    Chromium; a killed prefill node leaves the index and the rotation."""
    model_dir = tiny_models["llama"]
    outputs = {}
    rates = {}
    for policy in ("cache_aware", "round_robin"):
        cluster = fleet_cluster(str(model_dir), redis_proc.url, policy, 2, 2, 24100)
        with running_cluster(cluster, tmp_path / policy) as rc:
            convs = multi_turn(16, 4, first_len=40, turn_len=12, seed=1)
            rates[policy] = _hit_rate(rc, model_dir, convs, seed=2, max_tokens=32)
            outputs[policy] = [c.outputs for c in convs]
            if policy == "cache_aware" and shutil.which("chromium"):  # Debian's chromium package
                _check_dashboard(rc, model_dir, tmp_path)
            if policy == "cache_aware":
                _kill_prefill_node(rc, model_dir)
    print("prefix-hit rate / ideal:", rates)
    assert rates["cache_aware"] >= 0.9
    assert rates["round_robin"] <= 0.55
    assert outputs["cache_aware"] == outputs["round_robin"]
