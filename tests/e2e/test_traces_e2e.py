"""One request's trace across router, prefill, KV transfer and decode (real processes), exported
by OTLP to a collector this test runs in memory, asked through the official openai client."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

pytest.importorskip("opentelemetry.sdk", reason="the otel extra (opentelemetry-sdk) is not installed")
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tgrpc

from tests.e2e.cluster import make_cluster_config, running_cluster


class _Collector(tgrpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver keeping (service name, span) pairs."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, Any]] = []

    def Export(self, request: tpb.ExportTraceServiceRequest, context: grpc.ServicerContext) -> Any:
        for rs in request.resource_spans:
            service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
            self.spans += [(service, sp) for ss in rs.scope_spans for sp in ss.spans]
        return tpb.ExportTraceServiceResponse()


@pytest.fixture
def collector(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Collector]:
    c = _Collector()
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    tgrpc.add_TraceServiceServicer_to_server(c, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    # The node and router processes inherit these: export to us, every 100 ms.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    try:
        yield c
    finally:
        server.stop(grace=None)


def test_one_trace_across_router_prefill_transfer_decode(
    tiny_models: dict[str, Path], collector: _Collector, tmp_path: Path
) -> None:
    cluster = make_cluster_config(tiny_models["llama"], router={"local_prefill_max_tokens": 0})
    with running_cluster(cluster, tmp_path) as rc:
        client = openai.OpenAI(base_url=rc.base_url, api_key="unused", max_retries=0)
        out = client.completions.create(
            model=rc.model_name, prompt=list(range(20, 60)), max_tokens=4, temperature=0
        )
        assert out.choices[0].text
        want = {
            "router.request",
            "router.route",
            "router.prefill_leg",
            "router.decode_leg",
            "prefill",
            "decode",
        }
        want |= {"kv_transfer", "decode.queue", "decode.first_token", "decode.stream"}
        deadline = time.monotonic() + 15
        while not want <= {sp.name for _, sp in collector.spans}:
            assert time.monotonic() < deadline, (
                f"spans seen: {sorted({sp.name for _, sp in collector.spans})}"
            )
            time.sleep(0.1)
    # The request's trace: the one with the prefill span (readiness probes make traces of their own).
    (tid,) = {sp.trace_id for _, sp in collector.spans if sp.name == "prefill"}
    spans = [(svc, sp) for svc, sp in collector.spans if sp.trace_id == tid]
    by_name = {sp.name: (svc, sp) for svc, sp in spans}
    assert want <= set(by_name), sorted(by_name)  # one request, one trace
    assert len(spans) == len(by_name), sorted(sp.name for _, sp in spans)  # each span once
    root = by_name["router.request"][1]
    names = {sp.span_id: sp.name for _, sp in spans}
    # The trace starts in the router: router.request, under FastAPI's own HTTP spans if any.
    (top,) = [(svc, sp) for svc, sp in spans if not sp.parent_span_id]
    assert top[0] == "pdserve-router", top[1].name
    by_id = {sp.span_id: (svc, sp) for svc, sp in spans}
    up = root
    while up.parent_span_id:
        svc, up = by_id[up.parent_span_id]
        assert svc == "pdserve-router", up.name
    assert up is top[1]

    def parent(name: str) -> str:
        return names[by_name[name][1].parent_span_id]

    assert (
        parent("router.route")
        == parent("router.prefill_leg")
        == parent("router.decode_leg")
        == "router.request"
    )
    assert parent("prefill") == "router.prefill_leg"
    assert parent("decode") == "router.decode_leg"
    for child in ("kv_transfer", "decode.queue", "decode.first_token", "decode.stream"):
        assert parent(child) == "decode"
    assert by_name["prefill"][0] == "pdserve-prefill" and by_name["decode"][0] == "pdserve-decode"
    assert by_name["router.request"][0] == "pdserve-router"
    attrs = {a.key: a.value for a in root.attributes}
    assert attrs["pdserve.path"].string_value == "disaggregated"
    assert attrs["pdserve.prefill-node"].string_value == "prefill-0"
