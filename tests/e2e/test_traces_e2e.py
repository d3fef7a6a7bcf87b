"""One request's trace across router, prefill, KV transfer and decode (real processes, a static
node list, no Redis), exported by OTLP to a collector this test runs in memory, asked through the
official openai client. The fleet's default test (test_fleet_e2e.py) checks the same tree on a
Redis-registered cluster; this one joins PDSERVE_FULL_TESTS, with an image request's trace through
an encoder node."""

from __future__ import annotations

import os
import time
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


@pytest.mark.skipif(
    not os.environ.get("PDSERVE_FULL_TESTS"),
    reason="a LLaVA encoder + prefill + decode cluster (~45 s on 2 cores): PDSERVE_FULL_TESTS=1",
)
def test_an_image_requests_trace_joins_the_encoders_spans(collector: TraceCollector, tmp_path: Path) -> None:
    """A chat request with an image: router.encode (the Encode call) under the sequence's
    router.request, encoder.encode on the encoder node under it, in the same trace as prefill and
    decode."""
    pytest.importorskip("mooncake.engine")
    pytest.importorskip("PIL")
    from pdserve.models.make_model import make_tiny_model
    from tests.e2e.epd_cluster import epd_config, image_part, png
    from tests.e2e.test_epd_e2e import _wait_for_the_image_path
    from tests.registry.redis_proc import RedisProcess

    model_dir = make_tiny_model("llava", tmp_path / "llava")
    redis = RedisProcess().start()
    try:
        with running_cluster(epd_config(model_dir, redis.url, lease_s=3.0), tmp_path / "run") as rc:
            _wait_for_the_image_path(rc)
            client = openai.OpenAI(base_url=rc.base_url, api_key="unused", max_retries=0, timeout=60)
            out = client.chat.completions.create(
                model=rc.model_name,
                messages=[
                    {"role": "user", "content": [image_part(png(7)), {"type": "text", "text": "What?"}]}
                ],
                max_tokens=4,
                temperature=0,
            )
            spans = collector.trace_of(out.id)
            deadline = time.monotonic() + 10
            while "encoder.encode" not in {sp.name for _, sp in spans}:
                assert time.monotonic() < deadline, sorted(sp.name for _, sp in spans)
                time.sleep(0.1)
                spans = collector.trace_of(out.id)
    finally:
        redis.stop()
    by_name = {sp.name: (svc, sp) for svc, sp in spans}
    by_id = {sp.span_id: sp for _, sp in spans}
    assert by_id[by_name["router.encode"][1].parent_span_id].name == "router.request"
    assert by_id[by_name["encoder.encode"][1].parent_span_id].name == "router.encode"
    assert by_name["encoder.encode"][0] == "pdserve-encoder"
    assert by_id[by_name["prefill"][1].parent_span_id].name == "router.prefill_leg"
