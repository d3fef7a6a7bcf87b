"""The router workers' shared listening socket: connections accepted on it have Nagle off.

asyncio sets TCP_NODELAY only on sockets whose ``proto`` is IPPROTO_TCP; a socket from
``socket.create_server`` has proto 0, so with ``router.workers`` > 1 every response written in
two parts (headers, body) waited ~40 ms for the client's delayed ACK."""

from __future__ import annotations

import asyncio
import socket

import pytest

from services.router.server import BALANCED_ACCEPT, EXIT_CANNOT_LISTEN, listening_socket


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


@pytest.mark.skipif(not BALANCED_ACCEPT, reason="SO_REUSEPORT balancing is Linux's")
def test_the_workers_sockets_share_the_port_and_its_connections() -> None:
    """Each worker listens on its own SO_REUSEPORT socket; the kernel hashes connections over
    them, so no single worker takes a burst (64 connections all on one of 2: p = 2**-63)."""
    first = listening_socket("127.0.0.1", 0, reuse_port=True)
    port = first.getsockname()[1]
    second = listening_socket("127.0.0.1", port, reuse_port=True)
    clients = []
    try:
        for _ in range(64):
            c = socket.create_connection(("127.0.0.1", port))
            clients.append(c)
        counts = []
        for s in (first, second):
            s.setblocking(False)
            n = 0
            while True:
                try:
                    conn, _ = s.accept()
                except BlockingIOError:
                    break
                conn.close()
                n += 1
            counts.append(n)
        assert sum(counts) == 64 and min(counts) > 0, counts
        with pytest.raises(OSError):  # a socket outside the group cannot take the port
            listening_socket("127.0.0.1", port)
    finally:
        for c in clients:
            c.close()
        first.close()
        second.close()


def test_a_router_whose_port_is_taken_exits_71_naming_it(tiny_models, tmp_path) -> None:
    import subprocess
    import sys

    from pdserve.config.cluster import ClusterConfig, write_cluster_config

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    cfg = ClusterConfig.from_dict(
        {
            "model": str(tiny_models["llama"]),
            "router": {"host": "127.0.0.1", "port": port, "workers": 2},
            "nodes": [
                {"name": "d0", "role": "colocated", "host": "127.0.0.1", "grpc_port": 1, "metrics_port": 2}
            ],
        }
    )
    path = write_cluster_config(cfg, tmp_path / "c.yaml")
    try:
        r = subprocess.run(
            [sys.executable, "-m", "services.cli", "serve", "router", "--config", str(path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        holder.close()
    assert r.returncode == EXIT_CANNOT_LISTEN, r.stdout + r.stderr
    assert f"router cannot listen on 127.0.0.1:{port}" in r.stdout + r.stderr
