"""An OTLP/gRPC trace receiver that keeps spans in memory, for tests of pdserve's traces across
real processes (they export to it when OTEL_EXPORTER_OTLP_ENDPOINT names it), and the check of
one request's span tree."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tgrpc

WANT = {
    "router.request",
    "router.admission",
    "router.route",
    "router.prefill_leg",
    "router.decode_leg",
    "prefill",
    "prefill.queue",
    "prefill.compute",
    "prefill.kv_held",
    "decode",
    "kv_transfer",
    "decode.queue",
    "decode.first_token",
    "decode.stream",
}


class TraceCollector(tgrpc.TraceServiceServicer):
    """Keeps (service name, span) pairs; ``start`` points this process's children at it."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, Any]] = []
        self._server: grpc.Server | None = None

    def Export(self, request: tpb.ExportTraceServiceRequest, context: grpc.ServicerContext) -> Any:
        for rs in request.resource_spans:
            service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
            self.spans += [(service, sp) for ss in rs.scope_spans for sp in ss.spans]
        return tpb.ExportTraceServiceResponse()

    def start(self, monkeypatch: pytest.MonkeyPatch) -> TraceCollector:
        self._server = grpc.server(ThreadPoolExecutor(max_workers=2))
        tgrpc.add_TraceServiceServicer_to_server(self, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        # The node and router processes inherit these: export to us, every 100 ms.
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)

    def trace_of(self, response_id: str, timeout_s: float = 15.0) -> list[tuple[str, Any]]:
        """The spans of the request the router answered as ``response_id`` (its first sequence),
        once all of WANT arrived."""
        deadline = time.monotonic() + timeout_s
        while True:
            roots = [
                sp
                for _, sp in self.spans
                if sp.name == "router.request"
                and any(
                    a.key == "pdserve.request_id" and a.value.string_value.startswith(response_id)
                    for a in sp.attributes
                )
            ]
            spans = [(svc, sp) for svc, sp in self.spans if roots and sp.trace_id == roots[0].trace_id]
            if WANT <= {sp.name for _, sp in spans}:
                return spans
            assert time.monotonic() < deadline, (
                f"spans of {response_id}: {sorted(sp.name for _, sp in spans)}"
            )
            time.sleep(0.1)


def check_trace_tree(spans: list[tuple[str, Any]], prefill_node: str) -> None:
    """One disaggregated request: router -> (admission, route, prefill leg -> prefill -> its queue,
    compute, KV held; decode leg -> decode -> its queue, KV transfer (bytes, seconds), first token,
    stream), each span once, under the router's HTTP spans."""
    by_name = {sp.name: (svc, sp) for svc, sp in spans}
    assert len(spans) == len(by_name), sorted(sp.name for _, sp in spans)  # each span once
    by_id = {sp.span_id: (svc, sp) for svc, sp in spans}
    root = by_name["router.request"][1]
    # The trace starts in the router: router.request, under FastAPI's own HTTP spans if any.
    (top,) = [(svc, sp) for svc, sp in spans if not sp.parent_span_id]
    assert top[0] == "pdserve-router", top[1].name
    up = root
    while up.parent_span_id:
        svc, up = by_id[up.parent_span_id]
        assert svc == "pdserve-router", up.name
    assert up is top[1]

    def parent(name: str) -> str:
        return by_id[by_name[name][1].parent_span_id][1].name

    assert (
        parent("router.route")
        == parent("router.prefill_leg")
        == parent("router.decode_leg")
        == "router.request"
    )
    assert parent("router.admission") == "router.request"
    assert parent("prefill") == "router.prefill_leg"
    for child in ("prefill.queue", "prefill.compute", "prefill.kv_held"):
        assert parent(child) == "prefill" and by_name[child][0] == "pdserve-prefill", child
    # queue then compute, back to back, inside the prefill span
    queue, compute, prefill = (by_name[n][1] for n in ("prefill.queue", "prefill.compute", "prefill"))
    assert prefill.start_time_unix_nano <= queue.start_time_unix_nano
    assert queue.end_time_unix_nano == compute.start_time_unix_nano <= compute.end_time_unix_nano
    admission, request = by_name["router.admission"][1], root
    assert admission.start_time_unix_nano == request.start_time_unix_nano
    assert admission.end_time_unix_nano <= by_name["router.route"][1].start_time_unix_nano
    transfer = {a.key: a.value for a in by_name["kv_transfer"][1].attributes}
    held = {a.key: a.value for a in by_name["prefill.kv_held"][1].attributes}
    assert transfer["pdserve.kv_bytes"].int_value > 0 and transfer["pdserve.kv_seconds"].double_value >= 0
    assert held["pdserve.kv_bytes"].int_value == transfer["pdserve.kv_bytes"].int_value
    assert parent("decode") == "router.decode_leg"
    for child in ("kv_transfer", "decode.queue", "decode.first_token", "decode.stream"):
        assert parent(child) == "decode"
    assert by_name["prefill"][0] == "pdserve-prefill" and by_name["decode"][0] == "pdserve-decode"
    assert by_name["router.request"][0] == "pdserve-router"
    attrs = {a.key: a.value.string_value for a in root.attributes}
    assert attrs["pdserve.path"] == "disaggregated"
    assert attrs["pdserve.prefill-node"] == prefill_node
    assert {a.key: a.value.string_value for a in by_name["prefill"][1].attributes}[
        "pdserve.node"
    ] == prefill_node
