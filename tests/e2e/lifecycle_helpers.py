"""Shared by the lifecycle / chaos tests and bench/chaos.py: probes of real node processes."""

from __future__ import annotations

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
