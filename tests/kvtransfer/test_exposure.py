"""Mooncake's ports and the node's refusal to expose them (pdserve/kvtransfer/exposure.py)."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from pdserve.errors import ConfigError
from pdserve.kvtransfer import bind_shim
from pdserve.kvtransfer.exposure import check_kv_ports, is_loopback
from pdserve.procnet import listeners_of


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.3.4.5", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("10.0.0.7", False),
        ("pdserve-decode", False),
        ("::", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_a_mooncake_node_off_loopback_is_refused_unless_pinned_or_allowed(monkeypatch) -> None:
    monkeypatch.delenv(bind_shim.ENV_ADDRESS, raising=False)
    with pytest.raises(ConfigError) as e:
        check_kv_ports("d0", "tcp", "127.0.0.1", "10.0.0.7", allowed=False)
    msg = str(e.value)
    assert "'10.0.0.7' is not a loopback one" in msg and "allow_unauthenticated_kv_ports: true" in msg
    with pytest.raises(ConfigError):
        check_kv_ports("d0", "rdma", "0.0.0.0", "pdserve-decode", allowed=False)
    check_kv_ports("d0", "tcp", "10.0.0.7", "10.0.0.7", allowed=True)
    check_kv_ports("d0", "tcp", "127.0.0.1", "localhost", allowed=False)
    check_kv_ports("d0", "cuda_ipc", "10.0.0.7", "10.0.0.7", allowed=False)  # binds its host
    # with the shim sending wildcard binds to the node's address, that address may be any
    monkeypatch.setenv(bind_shim.ENV_ADDRESS, "10.0.0.7")
    monkeypatch.setenv("LD_PRELOAD", "/cache/bind_shim-0123.so")
    check_kv_ports("d0", "tcp", "10.0.0.7", "10.0.0.7", allowed=False)
    with pytest.raises(ConfigError):  # pinned to another address than this node binds
        check_kv_ports("d0", "tcp", "10.0.0.8", "10.0.0.8", allowed=False)


def _engine(conn) -> None:  # type: ignore[no-untyped-def]
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    from pdserve.kvtransfer.backend import MooncakeBackend

    backend = MooncakeBackend(host="127.0.0.1")
    conn.send((os.getpid(), int(backend.session_id.rsplit(":", 1)[1])))
    conn.recv()
    backend.close()


def _listeners_of_an_engine(shim: bool, monkeypatch) -> list:  # type: ignore[no-untyped-def]
    """The listening sockets of a fresh process running one MooncakeBackend on 127.0.0.1."""
    pytest.importorskip("mooncake.engine")
    if shim:
        lib = bind_shim.build()
        assert lib is not None, "no C compiler to build the bind shim"
        monkeypatch.setenv(bind_shim.ENV_ADDRESS, "127.0.0.1")
        monkeypatch.setenv("LD_PRELOAD", str(lib))  # the spawned interpreter starts with it
    else:
        monkeypatch.delenv(bind_shim.ENV_ADDRESS, raising=False)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_engine, args=(child,))
    proc.start()
    try:
        assert parent.poll(60), "the transfer engine did not start"
        pid, rpc_port = parent.recv()
        socks = listeners_of([pid])
        assert rpc_port in {s.port for s in socks}
        assert len(socks) == 2, socks  # handshake / RPC and TCP data
        return socks
    finally:
        parent.send("quit")
        proc.join(30)


@pytest.mark.slow
def test_the_installed_mooncake_listens_on_every_interface_unless_pinned(monkeypatch) -> None:
    """The measurement the refusal rests on: told 127.0.0.1 (as argument and as
    MC_TCP_BIND_ADDRESS), the transfer engine listens on the wildcard; under the bind shim both
    its ports are on 127.0.0.1. Should a Mooncake bind where it is told, the first assertion
    fails: then drop the shim and allow_unauthenticated_kv_ports."""
    assert all(s.wildcard for s in _listeners_of_an_engine(False, monkeypatch))
    pinned = _listeners_of_an_engine(True, monkeypatch)
    assert all(s.loopback and not s.wildcard for s in pinned), pinned
