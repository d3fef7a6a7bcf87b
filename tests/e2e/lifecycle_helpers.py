"""Shared by the lifecycle / chaos tests and bench/chaos.py: probes of real node processes."""

from __future__ import annotations

import os
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def held_state(rc: Any, names: list[str]) -> dict[str, tuple[int, int, int, int]]:
    """(blocks used, held requests, blocks held for transfer, stranded blocks) per live node."""
    out = {}
    for name in names:
        r = rc.load(name)
        out[name] = (
            r.num_blocks_used,
            r.num_held_requests,
            r.num_blocks_held_for_transfer,
            r.stranded_kv_blocks,
        )
    return out


def wait_nothing_held(rc: Any, names: list[str], timeout_s: float = 5.0) -> float:
    """Wait until no live node holds a block; returns the seconds it took (raises past timeout_s)."""
    t0 = time.monotonic()
    while True:
        state = held_state(rc, names)
        if all(s == (0, 0, 0, 0) for s in state.values()):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"blocks still held after {timeout_s} s: {state}")
        time.sleep(0.05)


def health_status(address: str) -> str:
    with grpc.insecure_channel(address) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=3)
        except grpc.RpcError as e:
            return f"unreachable ({e.code().name})"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


_owned = [False]


def own_port_range() -> None:
    """Start this process's clusters away from 31000, where every other test process starts:
    on a shared host a port freed by a killed node was taken by another engineer's cluster.
    Below 32768 (the ephemeral range, where outgoing connections and front-end sockets land)."""
    from tests.e2e import cluster

    if not _owned[0]:
        _owned[0] = True
        cluster._next_base[0] = 21000 + (os.getpid() % 700) * 13


def isolated_cluster_config(model_dir: Any, **kw: Any) -> Any:
    from tests.e2e.cluster import make_cluster_config

    own_port_range()
    return make_cluster_config(model_dir, span=7, **kw)


def two_prefill_config(model_dir: Any, *, router: dict[str, Any] | None = None, **overrides: Any) -> Any:
    """router + prefill-0 + prefill-1 + decode-0 on loopback (ports base .. base+6)."""
    from pdserve.config.cluster import ClusterConfig

    c = isolated_cluster_config(model_dir, router=router, **overrides)
    data = c.model_dump(mode="json", exclude_unset=True)
    base = c.router.port
    p1 = {**next(n for n in data["nodes"] if n["name"] == "prefill-0")}
    p1.update(name="prefill-1", grpc_port=base + 5, metrics_port=base + 6)
    p1.update(overrides.get("prefill-1", {}))
    data["nodes"].append(p1)
    return ClusterConfig.from_dict(data)
