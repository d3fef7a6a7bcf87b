"""A node whose port is taken says so in one line and exits with its own code (a node once died
with SIGSEGV after the bind error: the transfer engine's threads were still up)."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest

from pdserve.config.cluster import ClusterConfig, write_cluster_config
from services.launch import EXIT_STARTUP_FAILED
from services.launcher import pick_base_port, start_child
from tests.e2e.cluster import make_cluster_config

pytestmark = pytest.mark.slow


# CI takes the Steps socket's port; PDSERVE_FULL_TESTS=1 adds the other two (~10 s each on 2 cores)
PORTS = (
    ["metrics_port", "grpc_port", "frontend_port"]
    if os.environ.get("PDSERVE_FULL_TESTS")
    else ["frontend_port"]
)


@pytest.mark.parametrize("which", PORTS)
def test_a_decode_node_whose_port_is_taken_exits_with_the_port_named(tiny_models, tmp_path, which) -> None:
    cluster = make_cluster_config(tiny_models["llama"])
    if which == "frontend_port":  # the decode node's Steps socket listens there
        data = cluster.model_dump(mode="json", exclude_unset=True)
        d0 = next(n for n in data["nodes"] if n["name"] == "decode-0")
        d0["frontend_port"] = pick_base_port("127.0.0.1", d0["grpc_port"] + 7, span=1)
        cluster = ClusterConfig.from_dict(data)
    node = cluster.node("decode-0")
    port = getattr(node, which)
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # no SO_REUSEPORT: nobody shares it
    # SO_REUSEADDR: the port may still have connections in TIME_WAIT from earlier tests (the
    # free-port check passes them); a listening socket with it still keeps every other bind out
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", port))
    holder.listen(1)
    try:
        cfg = write_cluster_config(cluster, tmp_path / "cluster.yaml")
        child = start_child(cfg, "decode", "decode-0", tmp_path)
        try:
            rc = child.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            child.proc.kill()
            raise
        log = child.log_path.read_text(errors="replace")
    finally:
        holder.close()
    assert rc == EXIT_STARTUP_FAILED, f"exit code {rc}; log:\n{log[-3000:]}"
    said = {
        "metrics_port": f"cannot bind metrics port 127.0.0.1:{port}",
        "grpc_port": f"cannot bind gRPC port 127.0.0.1:{port}",
        "frontend_port": f"frontend_port {port}: Steps socket: cannot listen on 127.0.0.1:{port}",
    }[which]
    assert said in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
