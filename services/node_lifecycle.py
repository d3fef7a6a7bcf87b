"""A node's life around serving: registry membership, and the drain on SIGTERM.

Drain (what Kubernetes' terminationGracePeriodSeconds must leave room for):

    SIGTERM -> admissions refused (Prefill / Decode / GetLoad: UNAVAILABLE), gRPC health "" NOT_SERVING,
               registry entry marked draining (the router stops picking this node)
            -> wait until no admitted RPC, no running or waiting request and no held KV is left,
               at most drain_timeout_s; on timeout the remaining requests fail (their peers abort
               their legs and free their KV) and the count is logged
            -> deregister, stop the gRPC server, exit 0

Liveness stays SERVING during the drain (its own health service name), so a liveness probe does
not kill a node that is finishing its work.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2

from pdserve.registry.base import NodeEntry
from pdserve.registry.membership import Membership

if TYPE_CHECKING:
    from services.node import NodeBase

logger = logging.getLogger(__name__)

LIVENESS_SERVICE = "pdserve.liveness"  # k8s livenessProbe grpc.service; readiness uses ""
ADMISSION_METHODS = frozenset({"Prefill", "Decode", "GetLoad"})  # refused while draining
_POLL_S = 0.05


class DrainGate(grpc.aio.ServerInterceptor):
    """Counts admitted calls of ADMISSION_METHODS and refuses new ones once ``draining``."""

    def __init__(self) -> None:
        self.draining = False
        self.active = 0  # admitted Prefill / Decode calls not yet returned

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method.rsplit("/", 1)[-1]  # type: ignore[attr-defined]
        if handler is None or method not in ADMISSION_METHODS:
            return handler
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(handler.unary_unary, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(handler.unary_stream, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

    async def _refuse(self, context: grpc.aio.ServicerContext, method: str) -> None:
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"node is draining: {method} refused, use another")

    def _unary(self, inner: Any, method: str) -> Any:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if self.draining:
                await self._refuse(context, method)
            self.active += 1
            try:
                return await inner(request, context)
            finally:
                self.active -= 1

        return call

    def _stream(self, inner: Any, method: str) -> Any:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if self.draining:
                await self._refuse(context, method)
            self.active += 1
            result = inner(request, context)
            try:
                if inspect.isawaitable(result):  # a handler that writes with context.write()
                    await result
                    return
                async for m in result:
                    yield m
            finally:
                self.active -= 1
                if inspect.isasyncgen(result):
                    # On a cancelled call the server closes only this wrapper: close the servicer's
                    # generator now, so its own clean-up (aborting the engine request) runs at once.
                    await result.aclose()

        return call


async def start_membership(node: NodeBase) -> Membership | None:
    """Register the node in Redis when the cluster has a registry; None for the static list."""
    o = node.opts
    if not o.redis_url:
        return None
    from pdserve.registry.redis_registry import RedisRegistry

    entry = NodeEntry(
        name=o.name,
        role=o.role,
        address=o.advertise_address,
        epoch=node.epoch,
        stages=o.stages,
    )
    m = Membership(RedisRegistry(o.redis_url, ttl_s=o.registry_ttl_s), entry, o.registry_ttl_s / 3)
    await m.start()
    return m


def _work_left(node: NodeBase, gate: DrainGate) -> dict[str, int]:
    st = node.engine.scheduler.stats()
    left = {
        "rpcs": gate.active,
        "running": st.num_running,
        "waiting": st.num_waiting + st.num_waiting_for_remote_kv,
        "held_kv_blocks": node.held_transfer_blocks(),
    }
    return {k: v for k, v in left.items() if v}


async def drain(
    node: NodeBase, gate: DrainGate, health_servicer: health.aio.HealthServicer, membership: Membership | None
) -> bool:
    """Run the drain above; True if everything finished within ``drain_timeout_s``."""
    timeout_s = node.opts.drain_timeout_s
    gate.draining = True
    await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    if membership is not None:
        await membership.mark_draining()
    logger.info("draining %s: no new requests, up to %.0fs for in-flight work", node.opts.name, timeout_s)
    t0 = time.monotonic()
    while (left := _work_left(node, gate)) and time.monotonic() - t0 < timeout_s:
        await asyncio.sleep(_POLL_S)
    if left:
        logger.warning(
            "drain of %s timed out after %.0fs with %s left: failing them", node.opts.name, timeout_s, left
        )
        assert node.engine_loop is not None
        node.engine_loop.post_and_dispatch(lambda e: e.fail_all("node drain timed out"))
        await asyncio.sleep(0.5)  # let the error deltas reach their streams
    else:
        logger.info("drained %s in %.2fs", node.opts.name, time.monotonic() - t0)
    if membership is not None:
        await membership.stop()
    return not left


async def start_grpc_server(
    host: str,
    port: int,
    interceptors: list[grpc.aio.ServerInterceptor],
    add_servicers: Callable[[grpc.aio.Server], None],
    *,
    shared_token: str | None,
    metrics_port: int | None,
    registry: Any,
    ready: bool = True,
    max_receive_bytes: int | None = None,
    metrics_token: str | None = None,
) -> tuple[grpc.aio.Server, health.aio.HealthServicer, str]:
    """A node's gRPC server, started: the token check first (an unauthenticated call learns
    nothing), then ``interceptors``; the servicers, standard health (readiness ``""`` and
    liveness), ``/metrics`` on ``metrics_port``. Returns (server, health servicer, address).
    ``ready=False`` leaves readiness NOT_SERVING (liveness SERVING) until the caller sets it,
    once whatever else it starts (the Steps socket, membership) is up. ``max_receive_bytes``:
    the largest message a call may send (pdserve/rpc/limits.py; None: MAX_MESSAGE_BYTES);
    ``metrics_token``: ``/metrics`` answers only a request with ``Authorization: Bearer`` it."""
    from grpc_health.v1 import health_pb2_grpc

    from pdserve.rpc import channel
    from services.metrics_http import start_metrics_server

    if shared_token:
        interceptors = [channel.TokenAuthInterceptor(shared_token), *interceptors]
    options = channel.server_options(max_receive_bytes or channel.MAX_MESSAGE_BYTES)
    server = grpc.aio.server(options=options, interceptors=interceptors)
    add_servicers(server)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    addr = f"{host}:{port}"
    httpd = None
    if metrics_port:  # before gRPC: a port in use fails here with nothing to undo
        try:
            httpd, _ = start_metrics_server(host, metrics_port, registry, metrics_token)
        except OSError as e:
            raise OSError(f"cannot bind metrics port {host}:{metrics_port}: {e.strerror or e}") from e
    try:
        bound = server.add_insecure_port(addr)  # grpcio returns 0 or raises RuntimeError
    except RuntimeError:
        bound = 0
    if bound == 0:
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        raise OSError(f"cannot bind gRPC port {addr} (in use, or not an address of this host)")
    await server.start()
    readiness = (
        health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    await hs.set("", readiness)
    await hs.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    return server, hs, addr
