"""Shared gRPC settings: message size limits, the optional shared token, status mapping."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from pdserve.errors import CapacityError, EngineDeadError, InvalidRequestError

MAX_MESSAGE_BYTES = 512 << 20  # prompt_embeds and long prompts exceed gRPC's 4 MiB default
OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A dead or frozen (SIGSTOPped) peer is noticed by an unanswered ping within ~8 s, during a
    # call too, not by a long timeout (KEEPALIVE in README's timeout table).
    ("grpc.keepalive_time_ms", 5_000),
    ("grpc.keepalive_timeout_ms", 3_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # A peer that was down comes back within seconds, not after gRPC's default 120 s backoff cap.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


# Servers must accept the clients' idle keepalive pings, else they answer GOAWAY "too_many_pings".
SERVER_OPTIONS = [
    *OPTIONS,
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    # gRPC sets SO_REUSEPORT by default: a second node started on a port already taken would
    # silently share it (and answer the first one's clients). Refuse the bind instead.
    ("grpc.so_reuseport", 0),
]


def server_options(max_receive_bytes: int) -> list[tuple[str, int]]:
    """SERVER_OPTIONS with a node's own receive limit (pdserve/rpc/limits.py)."""
    assert 0 < max_receive_bytes <= MAX_MESSAGE_BYTES
    keep = [o for o in SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length"]
    return [*keep, ("grpc.max_receive_message_length", max_receive_bytes)]


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {token}"),) if token else None


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without the cluster's shared token (when one is configured), by metadata
    alone: the call's message is never read.

    A refused call gets a request-streaming handler that aborts before it asks for a message,
    whatever the method's own shape: gRPC reads a unary request whole (up to the receive limit)
    before its handler runs, a streamed one only when the handler iterates. So a stranger's
    400 MB message is neither buffered nor parsed (the sender is stopped by HTTP/2 flow control
    and the stream's reset), and the refusal comes before any servicer runs."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith("/grpc.health") or self._authorized(details):
            return await continuation(details)
        return _DENY

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                got = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(got, self._expected)
        return False


def _never_parsed(raw: bytes) -> Any:
    raise AssertionError("a refused call's message is never read")


async def _deny(requests: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong internal token")


_DENY = grpc.stream_unary_rpc_method_handler(_deny, request_deserializer=_never_parsed)


def error_to_status(e: BaseException) -> grpc.StatusCode:
    if isinstance(e, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(e, CapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(e, EngineDeadError):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL
