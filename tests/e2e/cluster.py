"""Start real node processes on loopback for end-to-end tests (the same commands `pdserve up` runs)."""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx

from pdserve.config.cluster import ClusterConfig, default_local_cluster, write_cluster_config
from pdserve.rpc import node_pb2 as pb
from pdserve.rpc import node_pb2_grpc as pb_grpc
from services.launcher import Child, pick_base_port, start_child, wait_ready

# Where this process's port search starts: random per process, so two test runs on one host do not
# race for the same free block between checking it and binding it (below the ephemeral range).
_next_base = [random.Random(os.getpid()).randrange(20000, 31000, 10)]


@dataclass
class RunningCluster:
    cluster: ClusterConfig
    children: list[Child]
    run_dir: Path

    @property
    def base_url(self) -> str:
        return self.cluster.router_url + "/v1"

    @property
    def model_name(self) -> str:
        return self.cluster.served_name(self.cluster.model)

    def node(self, name: str) -> Any:
        return self.cluster.node(name)

    def load(self, name: str) -> pb.LoadReport:
        n = self.cluster.node(name)
        token = self.cluster.shared_token
        metadata = (("authorization", f"Bearer {token}"),) if token else None
        with grpc.insecure_channel(n.grpc_address) as ch:
            stub = pb_grpc.PrefillServiceStub(ch) if n.role == "prefill" else pb_grpc.DecodeServiceStub(ch)
            return stub.GetLoad(pb.LoadRequest(), timeout=5, metadata=metadata)

    def logs(self) -> str:
        return "\n".join(
            f"--- {c.name}\n{c.log_path.read_text(errors='replace')[-3000:]}" for c in self.children
        )


def make_cluster_config(
    model_dir: Path, *, router: dict[str, Any] | None = None, span: int = 5, **node_overrides: Any
) -> ClusterConfig:
    """The default local cluster on a free block of ``span`` ports (more than 5 when the caller
    adds nodes on base+5 ..), below the ephemeral range."""
    if _next_base[0] + span > 32000:
        _next_base[0] = 20000
    base = pick_base_port("127.0.0.1", _next_base[0], span=span)
    _next_base[0] = base + 10
    c = default_local_cluster(model_dir, base)
    data = c.model_dump(mode="json", exclude_unset=True)
    data["router"] = {**data["router"], **(router or {})}
    for n in data["nodes"]:
        n.update(node_overrides.get(n["name"], {}))
        n.update(node_overrides.get("all", {}))
    return ClusterConfig.from_dict(data)


@contextlib.contextmanager
def running_cluster(
    cluster: ClusterConfig, run_dir: Path, *, router: bool = True
) -> Iterator[RunningCluster]:
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = write_cluster_config(cluster, run_dir / "cluster.yaml")
    children = [start_child(cfg, n.role, n.name, run_dir) for n in cluster.nodes]
    if router:
        children.append(start_child(cfg, "router", None, run_dir))
    rc = RunningCluster(cluster, children, run_dir)
    try:
        wait_ready(cluster, children, timeout_s=180, router=router)
        if router:  # the router's /ready needs a decode node only: a test's first request may
            # need the prefill nodes too (the router otherwise sends it to decode alone)
            _wait_in_rotation(rc, _rotated(cluster), timeout_s=30)
        yield rc
    except BaseException:
        print(rc.logs())
        raise
    finally:
        kill_children(children)


def kill_children(children: list[Child]) -> None:
    """Teardown: SIGKILL every child's process group at once. A SIGTERM'd node drains in
    milliseconds, then spends 2-3 s of CPU finalizing its interpreter (modules, torch) before it
    exits; the tests that assert the clean exit send SIGTERM themselves (tests/deploy/test_drain.py,
    tests/e2e/test_up.py, the router workers in tests/e2e/test_served_e2e.py)."""
    for c in children:
        # also when the leader exited: its workers (TP / PP ranks) may still be in the group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(c.proc.pid, signal.SIGKILL)
    for c in children:
        c.proc.wait()
        c.log.close()


def revive(rc: RunningCluster) -> None:
    """Start again every child of ``rc`` that exited (a test killed it), then wait until the
    cluster is ready: a cluster shared by several modules is whole at each module's start."""
    dead = [c for c in rc.children if c.proc.poll() is not None]
    for c in dead:
        c.log.close()
        rc.children.remove(c)
        run_dir = rc.run_dir / f"revived-{c.name}-{time.monotonic_ns()}"
        run_dir.mkdir()
        node = None if c.role == "router" else c.name
        rc.children.append(start_child(rc.run_dir / "cluster.yaml", c.role, node, run_dir))
    if dead:
        router = any(c.role == "router" for c in rc.children)
        wait_ready(rc.cluster, rc.children, timeout_s=180, router=router)
        if router:  # the router's /ready needs a decode node only: wait for every node's rotation
            _wait_in_rotation(rc, _rotated(rc.cluster), timeout_s=30)


def in_rotation(rc: RunningCluster, node: str) -> float | None:
    """The router's pdserve:router_node_in_rotation of ``node`` (None before its first poll)."""
    text = httpx.get(rc.cluster.router_url + "/metrics", timeout=5).text
    m = re.search(r'^pdserve:router_node_in_rotation\{node="' + node + r'"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else None


def _rotated(cluster: ClusterConfig) -> list[str]:
    """The nodes the router routes to and reports in rotation: prefill, decode and colocated ones
    (encoders are reached through the prefill nodes)."""
    return [n.name for n in cluster.nodes if n.role != "encoder"]


def _wait_in_rotation(rc: RunningCluster, names: list[str], timeout_s: float) -> None:
    """Until the router has every node in ``names`` in rotation."""
    deadline = time.monotonic() + timeout_s
    while not all(in_rotation(rc, n) == 1.0 for n in names):
        if time.monotonic() > deadline:
            raise TimeoutError(f"nodes {names} not all back in the router's rotation after {timeout_s} s")
        time.sleep(0.1)
