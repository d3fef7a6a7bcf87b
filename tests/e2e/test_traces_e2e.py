"""One request's trace across router, prefill, KV transfer and decode (real processes, a static
node list, no Redis), exported by OTLP to a collector this test runs in memory, asked through the
official openai client. The fleet's default test (test_fleet_e2e.py) checks the same tree on a
Redis-registered cluster; this one joins PDSERVE_FULL_TESTS."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

pytest.importorskip("opentelemetry.sdk", reason="the otel extra (opentelemetry-sdk) is not installed")

from tests.e2e.cluster import make_cluster_config, running_cluster
from tests.e2e.trace_collector import TraceCollector, check_trace_tree


@pytest.fixture
def collector(monkeypatch: pytest.MonkeyPatch) -> Iterator[TraceCollector]:
    c = TraceCollector().start(monkeypatch)
    try:
        yield c
    finally:
        c.close()


@pytest.mark.skipif(
    not os.environ.get("PDSERVE_FULL_TESTS"),
    reason="~20 s of cluster start on 2 cores; the fleet's default test checks the same tree: PDSERVE_FULL_TESTS=1",
)
def test_one_trace_across_router_prefill_transfer_decode(
    tiny_models: dict[str, Path], collector: TraceCollector, tmp_path: Path
) -> None:
    cluster = make_cluster_config(tiny_models["llama"], router={"local_prefill_max_tokens": 0})
    with running_cluster(cluster, tmp_path) as rc:
        client = openai.OpenAI(base_url=rc.base_url, api_key="unused", max_retries=0)
        out = client.completions.create(
            model=rc.model_name, prompt=list(range(20, 60)), max_tokens=4, temperature=0
        )
        assert out.choices[0].text
        spans = collector.trace_of(out.id)
    check_trace_tree(spans, "prefill-0")
