"""The router's side of the encoder nodes: send a request's images to one, get keys and lengths.

The encoders come from the cluster file (the nodes with ``role: encoder`` serving the model): the
router infers from it who produces embeddings (encoders) and who consumes them (prefill nodes,
EC consumers). Only the images' bytes go to the encoder; prefill gets the keys, decode neither.

    Encode ok                  -> [(key, length, cache_hit)], the encoder's gRPC address
    INVALID_ARGUMENT           -> InvalidRequestError (400: the image is malformed / too large)
    anything else, or timeout  -> CapacityError (503: retry; the circuit breaker counts node faults)
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import grpc

from pdserve import tracing
from pdserve.errors import CapacityError, InvalidRequestError
from pdserve.rpc import channel
from pdserve.rpc import node_pb2 as pb
from pdserve.rpc import node_pb2_grpc as pb_grpc
from services.router.breaker import CircuitBreaker, is_node_fault


@dataclass
class EncoderHandle:
    name: str
    address: str
    channel: grpc.aio.Channel
    in_flight: int = 0
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)


@dataclass(frozen=True)
class EncodedImage:
    key: str
    length: int
    cache_hit: bool


class EncoderPool:
    def __init__(
        self,
        encoders: list[tuple[str, str]],
        timeout_s: float = 60.0,
        shared_token: str | None = None,
        breaker_failures: int = 3,
        breaker_open_s: float = 5.0,
    ) -> None:
        self.timeout_s = timeout_s
        self._md = channel.auth_metadata(shared_token)
        self.handles = [
            EncoderHandle(
                n,
                a,
                grpc.aio.insecure_channel(a, options=channel.OPTIONS),
                breaker=CircuitBreaker(breaker_failures, breaker_open_s),
            )
            for n, a in encoders
        ]

    def __bool__(self) -> bool:
        return bool(self.handles)

    def _pick(self) -> EncoderHandle:
        live = [h for h in self.handles if h.breaker.available()] or self.handles
        if not live:
            raise CapacityError("no encoder node serves this model: image_url parts cannot be encoded")
        chosen = min(live, key=lambda h: h.in_flight)
        chosen.breaker.on_dispatch()
        return chosen

    async def encode(
        self, request_id: str, images: list[tuple[bytes, str | None]]
    ) -> tuple[list[EncodedImage], str]:
        """Keys and placeholder lengths of ``images`` (bytes, client uuid), and the encoder's address."""
        h = self._pick()
        msg = pb.EncodeRequest(
            request_id=request_id, images=[pb.EncodeImage(data=d, uuid=u or "") for d, u in images]
        )
        h.in_flight += 1
        # A child of the current span (the first sequence's router.request: chat.py), carried
        # to the encoder node in the call's metadata.
        span = tracing.tracer.start_span("router.encode", attributes={"pdserve.node": h.name})
        tp = tracing.traceparent(span)
        md = (*(self._md or ()), ("traceparent", tp)) if tp else self._md
        try:
            resp = await pb_grpc.EncoderServiceStub(h.channel).Encode(
                msg, timeout=self.timeout_s, metadata=md
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                h.breaker.record_success()  # the image's fault, not the node's
                raise InvalidRequestError(e.details() or "invalid image", field="messages") from e
            if is_node_fault(e.code()):
                h.breaker.record_failure()
            raise CapacityError(
                f"encoder {h.name} failed: {e.code().name}: {e.details()}; retry later"
            ) from e
        finally:
            h.in_flight -= 1
            span.end()
        h.breaker.record_success()
        if len(resp.items) != len(images):
            raise CapacityError(f"encoder {h.name} answered {len(resp.items)} items for {len(images)} images")
        # The replica that holds the bytes (its own advertised address), not a Service's
        return [EncodedImage(i.key, i.length, i.cache_hit) for i in resp.items], resp.address or h.address

    async def close(self) -> None:
        for h in self.handles:
            with contextlib.suppress(asyncio.CancelledError):
                await h.channel.close()
