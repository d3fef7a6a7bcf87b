"""What a local cluster (router + prefill + decode, api_key and shared_token set) listens on, and
what a stranger can do to it. Real processes started as `pdserve up` starts them.

- Every listening socket of the cluster's processes is on loopback, Mooncake's two ports per
  engine node (handshake and TCP data) too: the installed Mooncake binds every interface
  whatever it is told, so the node pins them with its bind shim (pdserve/kvtransfer/bind_shim.py).
- A node on another address (127.0.0.2) has Mooncake's ports there; a node that binds every
  interface (a DNS-named host) refuses to start, naming the reason and the setting.
- An unauthenticated 100 MB gRPC message is refused without decode's RSS growing (the token is
  checked from the metadata; the body is never read).
- 200 idle connections to the Steps socket do not stop the router's streams.
- /metrics wants the shared token.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import threading
from collections import deque

import grpc
import httpx
import openai
import pytest

from pdserve.config.cluster import ClusterConfig, write_cluster_config
from pdserve.rpc import node_pb2 as pb
from pdserve.rpc import node_pb2_grpc as pb_grpc
from services.launch import EXIT_CONFIG_REFUSED
from services.launcher import start_child, wait_ready
from tests.e2e.cluster import kill_children, make_cluster_config, running_cluster
from tests.e2e.proc_sockets import descendants, listeners_of, vm_rss_bytes

pytestmark = pytest.mark.slow
TOKEN = "internal-s3cret"
API_KEY = "client-key"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
MIB = 1 << 20


def _config(tiny_models) -> ClusterConfig:
    cfg = make_cluster_config(tiny_models["llama"], router={"api_key": API_KEY})
    return cfg.model_copy(update={"shared_token": TOKEN, "metrics_require_token": True})


@pytest.fixture(scope="module")
def nodes_then_router(tiny_models, tmp_path_factory):
    """Prefill and decode, then (by the test) the router: strangers can be at the door first."""
    cfg = _config(tiny_models)
    with running_cluster(cfg, tmp_path_factory.mktemp("ports"), router=False) as rc:
        yield rc


def _mooncake_ports(log: str) -> set[int]:
    """The handshake and TCP data ports Mooncake's log names."""
    rpc = re.findall(r"P2P handshake, listening on [^\s:]+:(\d+)", log)
    data = re.findall(r"TcpTransport: listen on port (\d+)", log)
    assert len(rpc) == 1 and len(data) == 1, f"expected one Mooncake engine in the log:\n{log[-2000:]}"
    return {int(rpc[0]), int(data[0])}


def _decode_steps_socket(rc) -> str:
    d0 = rc.cluster.node("decode-0")
    with grpc.insecure_channel(d0.grpc_address) as ch:
        rep = pb_grpc.DecodeServiceStub(ch).GetLoad(pb.LoadRequest(), timeout=10, metadata=AUTH)
    assert rep.steps_socket
    return rep.steps_socket


class _IdleFlood:
    """Holds ``n`` idle connections to ``address`` from this host, replacing any the node closes
    (and the oldest, to keep opening new ones): a stranger that never says hello."""

    def __init__(self, address: str, n: int) -> None:
        host, port = address.rsplit(":", 1)
        self.target = (host, int(port))
        self.n = n
        self.opened = 0
        self._socks: deque[socket.socket] = deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _IdleFlood:
        for _ in range(self.n):
            self._open()
        self._thread.start()
        return self

    def _open(self) -> None:
        self._socks.append(socket.create_connection(self.target, timeout=5))
        self.opened += 1

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self._socks.popleft().close()
            self._open()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        for s in self._socks:
            s.close()


def test_200_idle_connections_at_the_steps_socket_do_not_stop_the_routers_streams(nodes_then_router) -> None:
    rc = nodes_then_router
    cfg = rc.run_dir / "cluster.yaml"
    with _IdleFlood(_decode_steps_socket(rc), 200) as flood:
        router = start_child(cfg, "router", None, rc.run_dir)
        try:
            # the router's first hello comes while the strangers hold their connections
            wait_ready(rc.cluster, [router], timeout_s=120, router=True)
            client = openai.OpenAI(base_url=rc.base_url, api_key=API_KEY, max_retries=0, timeout=60)
            for i in range(4):
                stream = client.completions.create(
                    model=rc.model_name,
                    prompt=[5, 6, 7, i],
                    max_tokens=6,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                assert sum(1 for c in stream if c.choices and c.choices[0].text is not None) >= 1
                r = client.completions.create(
                    model=rc.model_name, prompt=[5, 6, i], max_tokens=5, extra_body={"ignore_eos": True}
                )
                assert r.usage.completion_tokens == 5
            assert flood.opened >= 200
        finally:
            kill_children([router])
    refused = httpx.get(
        f"http://{rc.cluster.node('decode-0').metrics_address}/metrics",
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=10,
    ).text
    m = re.search(r"pdserve:steps_socket_refused_total\{[^}]*\} (\d+)", refused)
    assert m and int(float(m.group(1))) >= 1, "the strangers were closed, not served"


def test_an_unauthenticated_100mb_message_is_refused_unread(nodes_then_router) -> None:
    rc = nodes_then_router
    d0 = rc.cluster.node("decode-0")
    pid = next(c.proc.pid for c in rc.children if c.name == "decode-0")
    big = pb.AbortRequest(request_ids=["x" * (100 * MIB)])
    opts = [("grpc.max_send_message_length", 512 * MIB)]
    for metadata, code in (
        (None, grpc.StatusCode.UNAUTHENTICATED),
        (AUTH, grpc.StatusCode.RESOURCE_EXHAUSTED),
    ):
        before = vm_rss_bytes(pid)
        with grpc.insecure_channel(d0.grpc_address, options=opts) as ch:
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.DecodeServiceStub(ch).Abort(big, timeout=60, metadata=metadata)
        grown = vm_rss_bytes(pid) - before
        # without the token: refused by its metadata; with it: past the model's receive limit
        assert e.value.code() == code, (e.value.code(), e.value.details())
        assert grown < 50 * MIB, f"decode's RSS grew {grown / MIB:.1f} MiB for a refused message"


def test_metrics_want_the_shared_token(nodes_then_router) -> None:
    url = f"http://{nodes_then_router.cluster.node('decode-0').metrics_address}/metrics"
    assert httpx.get(url, timeout=10).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
    ok = httpx.get(url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert ok.status_code == 200 and "pdserve:kv_blocks_used" in ok.text


def test_every_listening_socket_is_loopback_mooncakes_too(nodes_then_router) -> None:
    rc = nodes_then_router
    router = start_child(rc.run_dir / "cluster.yaml", "router", None, rc.run_dir)
    try:
        wait_ready(rc.cluster, [router], timeout_s=120, router=True)
        children = [*rc.children, router]
        by_name = {c.name: descendants([c.proc.pid]) for c in children}
        mooncake = {
            c.name: _mooncake_ports(c.log_path.read_text(errors="replace"))
            for c in children
            if c.name in ("prefill-0", "decode-0")
        }
        listeners = {name: listeners_of(pids) for name, pids in by_name.items()}
    finally:
        kill_children([router])
    for name, socks in listeners.items():
        for sock in socks:
            assert sock.loopback and not sock.wildcard, f"{name} listens on {sock.address}:{sock.port}"
    # router HTTP; per node gRPC + metrics (+ decode's Steps socket) + Mooncake's two
    assert len(listeners["router"]) >= 1
    assert len(listeners["prefill-0"]) == 4 and len(listeners["decode-0"]) == 5, listeners
    for name, ports in mooncake.items():
        assert ports <= {s.port for s in listeners[name]}, (name, ports, listeners[name])


def _start_alone(tiny_models, tmp_path, host: str):  # type: ignore[no-untyped-def]
    """decode-0 of the test cluster, started alone with ``host`` as its address."""
    cfg = _config(tiny_models)
    data = cfg.model_dump(mode="json", exclude_unset=True)
    for n in data["nodes"]:
        if n["name"] == "decode-0":
            n["host"] = host
    cluster = ClusterConfig.from_dict(data)
    path = write_cluster_config(cluster, tmp_path / "cluster.yaml")
    return cluster, start_child(path, "decode", "decode-0", tmp_path)


@pytest.mark.skipif(
    not os.environ.get("PDSERVE_FULL_TESTS"),
    reason="~10 s on 2 cores: PDSERVE_FULL_TESTS=1 runs it (every listening socket of a cluster, Mooncake's "
    "included, is checked on the node's own address by test_every_listening_socket_is_loopback_mooncakes_too)",
)
def test_a_node_on_another_address_has_mooncakes_ports_there(tiny_models, tmp_path) -> None:
    cluster, child = _start_alone(tiny_models, tmp_path, "127.0.0.2")
    try:
        wait_ready(
            cluster.model_copy(update={"nodes": (cluster.node("decode-0"),)}), [child], 120, router=False
        )
        socks = listeners_of(descendants([child.proc.pid]))
        log = child.log_path.read_text(errors="replace")
    finally:
        kill_children([child])
    ports = _mooncake_ports(log)
    assert ports <= {s.port for s in socks}
    bound = {getattr(s.address, "ipv4_mapped", None) or s.address for s in socks}
    assert bound == {ipaddress.IPv4Address("127.0.0.2")}, socks


def test_a_node_that_binds_every_interface_refuses_to_start_with_the_reason(tiny_models, tmp_path) -> None:
    _, child = _start_alone(tiny_models, tmp_path, "decode-0.pdserve.invalid")  # binds 0.0.0.0
    try:
        rc = child.proc.wait(timeout=120)
    finally:
        kill_children([child])
    log = child.log_path.read_text(errors="replace")
    assert rc == EXIT_CONFIG_REFUSED, f"exit code {rc}; log:\n{log[-3000:]}"
    assert "node decode-0 refuses to start" in log and "is not a loopback one" in log, log[-3000:]
    assert "allow_unauthenticated_kv_ports: true" in log and "Traceback" not in log, log[-3000:]
