"""The cuda_ipc directory: a tiny JSON-over-TCP server on ``host`` that answers one question,
"which ranges are registered here and under which CUDA IPC handle", plus its process's epoch;
the client call that asks it, the session string that addresses it, and the lookup of a target
in its answer. ``CudaIpcBackend`` (kvtransfer/cuda_ipc.py) serves its registrations here and
asks its peers through ``ask_ranges``.

``session_id`` is ``"host:port/epoch"``: a peer that restarted on the same port has a new epoch
and every write addressed to the old session is refused (the bytes it held for earlier transfers
are gone), exactly as the KV handshake refuses it one level up. Nothing from the network is
unpickled: the directory speaks JSON (a request line of at most 4096 bytes, a reply of at most
``_MAX_REPLY_BYTES``), and handles travel as hex. It listens on the node's own ``host``, never
on every interface.
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
from collections.abc import Callable
from typing import Any

_MAX_REPLY_BYTES = 1 << 20


class _Directory(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class DirectoryServer:
    """Answers ``{"op": "ranges"}`` with ``answer()`` (any other request with an error object)
    on a port of ``host`` picked by the OS, from a daemon thread, until ``close``."""

    def __init__(self, host: str, answer: Callable[[], dict[str, Any]]) -> None:
        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                line = self.rfile.readline(4096)
                try:
                    op = json.loads(line).get("op")
                except (ValueError, AttributeError):
                    op = None
                reply = answer() if op == "ranges" else {"error": f"unknown request {line[:64]!r}"}
                self.wfile.write(json.dumps(reply).encode() + b"\n")

        self._server = _Directory((host, 0), Handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="cuda-ipc-directory", daemon=True
        )
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def ask_ranges(host: str, port: int, timeout_s: float) -> dict[str, Any]:
    """One round trip to the directory at ``host:port``: its reply object (ValueError if the
    reply is too large or not a JSON object; OSError if the peer does not answer)."""
    with socket.create_connection((host, port), timeout=timeout_s) as s:
        s.sendall(b'{"op": "ranges"}\n')
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
            if len(buf) > _MAX_REPLY_BYTES:
                raise ValueError("directory reply too large")
    reply = json.loads(buf)
    if not isinstance(reply, dict):
        raise ValueError("directory reply is not an object")
    return reply


def parse_session(session: str) -> tuple[str, int, str]:
    """``"host:port/epoch"`` -> (host, port, epoch); ValueError names the bad value."""
    addr, sep, epoch = session.partition("/")
    host, _, port = addr.rpartition(":")
    if not sep or not epoch or not host or not port.isdigit():
        raise ValueError(f"not a cuda_ipc session {session!r}: expected 'host:port/epoch'")
    return host, int(port), epoch


def find_range(ranges: list[dict[str, Any]], dst: int, n: int) -> dict[str, Any] | None:
    """The entry of a directory answer's ``ranges`` holding ``[dst, dst + n)``, or None."""
    for r in ranges:
        if int(r["addr"]) <= dst and dst + n <= int(r["addr"]) + int(r["length"]):
            return r
    return None
