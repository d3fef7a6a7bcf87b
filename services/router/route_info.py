"""Per-request routing facts as response headers (``x-pdserve-prefill-node`` and the like).

A plain ASGI middleware puts a fresh dict in a context variable for each HTTP request; the backend
notes into it while choosing nodes (tasks it starts share the same dict), and the headers go out
with the response's start (for a stream: with its first event, after both choices were made).
"""

from __future__ import annotations

from contextvars import ContextVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

_ROUTE: ContextVar[dict[str, str] | None] = ContextVar("pdserve_route", default=None)
HEADER_PREFIX = "x-pdserve-"


def note_route(name: str, value: str | int) -> None:
    """Record ``x-pdserve-<name>`` for this request (the first sequence's choice is kept)."""
    route = _ROUTE.get()
    if route is not None:
        route.setdefault(name, str(value))


def route_of_request() -> dict[str, str]:
    """What was noted so far for this request (a copy; empty outside a request)."""
    return dict(_ROUTE.get() or {})


def route_attributes() -> dict[str, str]:
    """What was noted so far, as span attributes (``pdserve.prefill-node`` and the like)."""
    return {f"pdserve.{k}": v for k, v in (_ROUTE.get() or {}).items()}


class RouteHeaders:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route: dict[str, str] = {}
        token = _ROUTE.set(route)

        async def send_with_route(message: Message) -> None:
            if message["type"] == "http.response.start" and route:
                headers = list(message.get("headers", []))
                headers += [((HEADER_PREFIX + k).encode(), v.encode()) for k, v in route.items()]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_route)
        finally:
            _ROUTE.reset(token)
