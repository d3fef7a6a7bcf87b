"""Listening sockets of the processes that serve TCP: the router's HTTP port and a node's
Steps socket (services/steps_socket.py)."""

from __future__ import annotations

import socket


def listening_socket(
    host: str | None,
    port: int,
    backlog: int = 2048,
    *,
    reuse_port: bool = False,
    listen: bool = True,
    dual_stack: bool = False,
) -> socket.socket:
    """A TCP listening socket on ``host``'s first address, made as asyncio makes its own: with
    ``proto`` IPPROTO_TCP.
    asyncio turns Nagle off (TCP_NODELAY) only on connections whose socket says IPPROTO_TCP;
    ``socket.create_server`` leaves proto 0, so every accepted connection kept Nagle, and a
    response written as headers then body waited for the client's delayed ACK: ~40 ms per
    non-streamed request (0.75 of one worker's throughput at concurrency 1, H200 and CPU).
    ``reuse_port``: one of the router workers' SO_REUSEPORT group (otherwise a second process on
    a taken port fails instead of sharing it); ``listen`` False only binds; ``dual_stack``: an
    IPv6 wildcard takes IPv4 too, as gRPC's ports do (a node's Steps socket)."""
    family, type_, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if dual_stack and family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(addr)
        if listen:
            sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock
