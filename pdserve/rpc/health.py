"""gRPC health checks of nodes (what readiness waits use)."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def is_serving(address: str, timeout_s: float = 1.0, service: str = "") -> bool:
    """True when the node at ``address`` answers its health check (of ``service``) with SERVING."""
    with grpc.insecure_channel(address) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
        return r.status == health_pb2.HealthCheckResponse.SERVING
