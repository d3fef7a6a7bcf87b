"""Where Mooncake's ports listen, and when a node may start with them.

Measured with ``mooncake-transfer-engine-non-cuda`` 0.3.13.post1 (``ss -ltnp`` on a process
that called ``TransferEngine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")``): the
handshake / RPC port listens on ``0.0.0.0`` and the TCP data port on ``*`` (IPv6, dual stack),
although the log says ``listening on 127.0.0.1:PORT``. Neither moved with
``MC_TCP_BIND_ADDRESS``, ``MC_HANDSHAKE_PORT``, ``MC_LEGACY_RPC_PORT_BINDING``,
``MC_RPC_PROTOCOL``, ``MC_USE_TEV1``, ``MC_USE_TENT``, ``initialize_ext``, or a
``host:port`` / ``localhost`` server name (``MC_USE_IPV6=0`` put both on ``*``). The data port
takes reads and writes of any registered range (the whole KV cache) from whoever connects; no
token or peer check exists. Pinned by the bind shim (bind_shim.py), they listen on the node's
bind address instead; ``pdserve serve`` uses it whenever that address is an IP. Without it (a
DNS-named host binds every interface; no C compiler) a Mooncake node (``kv_transport`` tcp or
rdma; an encoder's embedding buffer too) refuses to start when its address is not a loopback
one, unless the cluster file says ``allow_unauthenticated_kv_ports: true`` (the operator keeps
those ports off the network: a firewall, the Kubernetes NetworkPolicy in deploy/k8s/base).
"""

from __future__ import annotations

import ipaddress
from importlib import metadata

from pdserve.errors import ConfigError
from pdserve.kvtransfer import bind_shim
from pdserve.kvtransfer.backend import TransferBackend
from pdserve.procnet import listeners_of

MOONCAKE_TRANSPORTS = ("tcp", "rdma")


def is_loopback(host: str) -> bool:
    """``host`` names this machine's loopback only (127.0.0.0/8, ::1, localhost)."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a DNS name: reachable from elsewhere


def mooncake_version() -> str:
    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return "mooncake (version unknown)"


def check_kv_ports(node: str, kv_transport: str, bind_host: str, kv_host: str, allowed: bool) -> None:
    """Before Mooncake starts: refuse (ConfigError) a Mooncake node whose ports would listen on
    every interface of a non-loopback host, unless ``allowed`` (``allow_unauthenticated_kv_ports``).
    With the bind shim active (bind_shim.py) they follow ``bind_host``, the node's own address."""
    if kv_transport not in MOONCAKE_TRANSPORTS or allowed or bind_shim.active(bind_host):
        return
    exposed = [h for h in (bind_host, kv_host) if not is_loopback(h)]
    if not exposed:
        return
    raise ConfigError(
        f"node {node!r}: kv_transport {kv_transport} runs Mooncake's Transfer Engine "
        f"({mooncake_version()}), which listens on every interface (0.0.0.0 and [::]) for its "
        "handshake and TCP data ports whatever address it is given, and reads or writes the "
        "node's registered KV memory for anyone who connects, with no authentication. The node's "
        f"address {exposed[0]!r} is not a loopback one and its bind address is not an IP this "
        "process could pin them to (kvtransfer/bind_shim.py; it needs a C compiler), so those "
        "ports would be open to the network. Give the node an IP host (its own address), or keep "
        "the ports reachable only by the cluster's nodes (a firewall, or the NetworkPolicy in "
        "deploy/k8s/base) and set allow_unauthenticated_kv_ports: true in the cluster file"
    )


def check_no_wildcard(
    node: str, kv_transport: str, bind_host: str, allowed: bool, backend: TransferBackend
) -> None:
    """After Mooncake started under the bind shim: none of this process's listening sockets may
    be a wildcard (a Mooncake that binds another way would slip past the shim); refusing, it
    closes ``backend`` first."""
    if kv_transport not in MOONCAKE_TRANSPORTS or allowed or not bind_shim.active(bind_host):
        return
    wild = sorted(s.port for s in listeners_of(["self"]) if s.wildcard)
    if wild:
        backend.close()
        raise ConfigError(
            f"node {node!r}: ports {wild} listen on every interface although wildcard binds "
            f"should go to {bind_host} (kvtransfer/bind_shim.py): {mooncake_version()} binds "
            "another way; set allow_unauthenticated_kv_ports: true only with those ports fenced off"
        )
