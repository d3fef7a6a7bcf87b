"""A node's Prometheus ``/metrics`` HTTP server: on the node's bind address, optionally behind
the cluster's shared token (``metrics_require_token``)."""

from __future__ import annotations

import hmac
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIServer, make_server

from prometheus_client import exposition

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def token_guarded(app: WsgiApp, token: str) -> WsgiApp:
    """``app`` answering only requests with ``Authorization: Bearer <token>`` (compared in
    constant time); others get 401 and no metrics."""
    expected = f"Bearer {token}".encode()

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        got = environ.get("HTTP_AUTHORIZATION", "").encode("latin-1")
        if hmac.compare_digest(got, expected):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
        return [b"missing or wrong bearer token (the cluster's shared_token)\n"]

    return guarded


def start_metrics_server(
    host: str, port: int, registry: Any, token: str | None
) -> tuple[WSGIServer, threading.Thread]:
    """Serve ``registry`` on ``host:port`` from a daemon thread (as prometheus_client's
    ``start_http_server``, plus the optional token); OSError if the port cannot be bound."""

    class Server(exposition.ThreadingWSGIServer):
        pass

    Server.address_family, addr = exposition._get_best_family(host, port)
    app: WsgiApp = exposition.make_wsgi_app(registry)
    if token:
        app = token_guarded(app, token)
    httpd = make_server(addr, port, app, Server, handler_class=exposition._SilentHandler)
    thread = threading.Thread(target=httpd.serve_forever, name="pdserve-metrics", daemon=True)
    thread.start()
    return httpd, thread
