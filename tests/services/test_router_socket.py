"""The router workers' shared listening socket: connections accepted on it have Nagle off.

asyncio sets TCP_NODELAY only on sockets whose ``proto`` is IPPROTO_TCP; a socket from
``socket.create_server`` has proto 0, so with ``router.workers`` > 1 every response written in
two parts (headers, body) waited ~40 ms for the client's delayed ACK."""

from __future__ import annotations

import asyncio
import socket

import pytest

from services.router.server import listening_socket


async def _nodelay_of_accepted(sock: socket.socket) -> int:
    seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        s = writer.get_extra_info("socket")
        seen.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(on_conn, sock=sock)
    host, port = sock.getsockname()[:2]
    _, w = await asyncio.open_connection(host, port)
    try:
        return await asyncio.wait_for(seen, 5)
    finally:
        w.close()
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_connections_accepted_on_the_workers_socket_have_nagle_off(host: str) -> None:
    sock = listening_socket(host, 0)
    assert sock.proto == socket.IPPROTO_TCP
    assert asyncio.run(_nodelay_of_accepted(sock)) != 0


def test_a_create_server_socket_keeps_nagle_on_its_connections() -> None:
    """What the test above guards against (so it can fail): proto 0, Nagle left on."""
    sock = socket.create_server(("127.0.0.1", 0))
    assert asyncio.run(_nodelay_of_accepted(sock)) == 0
