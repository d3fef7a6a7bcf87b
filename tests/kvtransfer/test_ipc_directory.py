"""The cuda_ipc directory on its own: the server's answers over real TCP, its bind address, and
the client's checks of a reply (kvtransfer/ipc_directory.py)."""

from __future__ import annotations

import json
import socket

import pytest

from pdserve.kvtransfer.ipc_directory import DirectoryServer, ask_ranges, find_range


def _send(port: int, line: bytes) -> dict[str, object]:
    with socket.create_connection(("127.0.0.1", port), timeout=5.0) as s:
        s.sendall(line)
        reply = s.makefile("rb").readline()
    return json.loads(reply)


def test_directory_answers_ranges_and_refuses_anything_else():
    answer = {"epoch": "e1", "ranges": [{"addr": 4096, "length": 1024}]}
    server = DirectoryServer("127.0.0.1", lambda: answer)
    try:
        assert server._server.server_address[0] == "127.0.0.1"  # the host given, not every interface
        assert ask_ranges("127.0.0.1", server.port, 5.0) == answer
        assert "unknown request" in str(_send(server.port, b'{"op": "handles"}\n')["error"])
        assert "unknown request" in str(_send(server.port, b"\x80\x04pickle\n")["error"])
    finally:
        server.close()
    with pytest.raises(OSError):
        ask_ranges("127.0.0.1", server.port, 1.0)  # closed: nothing answers


def test_client_refuses_a_reply_that_is_not_an_object():
    server = DirectoryServer("127.0.0.1", lambda: [1, 2])  # type: ignore[arg-type,return-value]
    try:
        with pytest.raises(ValueError, match="not an object"):
            ask_ranges("127.0.0.1", server.port, 5.0)
    finally:
        server.close()


def test_find_range_holds_the_whole_target():
    ranges = [{"addr": 0, "length": 100}, {"addr": 200, "length": 100}]
    assert find_range(ranges, 250, 50) is ranges[1]
    assert find_range(ranges, 90, 20) is None  # straddles the end of the first range
