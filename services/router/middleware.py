"""Plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which re-buffers every streamed
chunk through a memory channel): caps the request body and counts error answers."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.router.errors import APIError
from services.router.metrics import RouterMetrics


class RequestGuard:
    def __init__(self, app: ASGIApp, metrics: RouterMetrics, max_body_bytes: int) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_body_bytes:
                await self._reject(scope, receive, send)
                return
        num_body_bytes = 0
        rejected = False

        async def capped_receive() -> Message:
            # Chunked bodies carry no Content-Length: count as they arrive. Past the cap we answer
            # 413 ourselves, tell the app the client left, and drop whatever it answers.
            nonlocal num_body_bytes, rejected
            message = await receive()
            if message["type"] == "http.request" and not rejected:
                num_body_bytes += len(message.get("body", b""))
                if num_body_bytes > self.max_body_bytes:
                    rejected = True
                    await self._reject(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def counting_send(message: Message) -> None:
            if rejected:
                return
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self.metrics.http_errors.labels(status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, capped_receive, counting_send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.metrics.http_errors.labels(status="413").inc()
        error = APIError(413, f"request body exceeds {self.max_body_bytes} bytes", code="request_too_large")
        await error.response()(scope, receive, send)
