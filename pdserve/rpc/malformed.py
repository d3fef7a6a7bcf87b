"""Malformed gRPC requests are INVALID_ARGUMENT, not UNKNOWN (fuzz).

gRPC answers a request whose bytes do not parse with ``UNKNOWN: Unexpected DecodeError``; to a
caller that reads like a node fault (a router's breaker would count it). This interceptor parses
the request itself and answers ``INVALID_ARGUMENT`` naming the message type.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError


class _Malformed:
    def __init__(self, error: str) -> None:
        self.error = error


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        method = details.method

        def safe_parse(raw: bytes) -> Any:
            try:
                return parse(raw)
            except DecodeError as e:
                return _Malformed(f"{method}: the request does not parse ({e})")

        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def checked_unary(req: Any, ctx: grpc.aio.ServicerContext) -> Any:
                if isinstance(req, _Malformed):
                    await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, req.error)
                return await unary(req, ctx)

            return grpc.unary_unary_rpc_method_handler(
                checked_unary,
                request_deserializer=safe_parse,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            stream = handler.unary_stream

            async def checked_stream(req: Any, ctx: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                if isinstance(req, _Malformed):
                    await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, req.error)
                async for m in stream(req, ctx):
                    yield m

            return grpc.unary_stream_rpc_method_handler(
                checked_stream,
                request_deserializer=safe_parse,
                response_serializer=handler.response_serializer,
            )
        return handler
