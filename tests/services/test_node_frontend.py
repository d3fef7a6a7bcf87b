"""services/node_frontend.py alone: the frontend_port a node refuses at start, and the address
its Steps socket advertises (a real listening StepsFront on a free port; the settings a stand-in
for NodeSpec, whose cluster-file checks refuse these ports first)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from pdserve.config.choices import Role
from pdserve.errors import ConfigError
from services.node_frontend import check_frontend_port, start_steps_front


def _opts(**kw: Any) -> Any:
    base = {
        "name": "d0",
        "role": Role.DECODE,
        "host": "127.0.0.1",
        "grpc_port": 50061,
        "metrics_port": 50062,
        "frontend_port": None,
        "advertise_address": "",
        "shared_token": None,
        "steps_hello_timeout_s": 1.0,
        "steps_max_pending_per_peer": 4,
    }
    return SimpleNamespace(**(base | kw))


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"role": Role.PREFILL, "frontend_port": 50070}, "a prefill node serves no Steps streams"),
        ({"frontend_port": 50061}, "is also its grpc or metrics port"),
        ({"frontend_port": 50062}, "is also its grpc or metrics port"),
    ],
)
def test_a_frontend_port_the_node_cannot_serve_is_refused(kw: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        check_frontend_port(_opts(**kw))


def test_frontend_port_none_or_zero_or_distinct_is_taken() -> None:
    for port in (None, 0, 50070):
        check_frontend_port(_opts(frontend_port=port))
    check_frontend_port(_opts(role=Role.PREFILL))


@pytest.mark.parametrize(
    ("advertise", "host"),
    [
        ("", "127.0.0.1"),  # none advertised: the bind host with the grpc port
        ("node-a.example:50061", "node-a.example"),
        ("fd00::5:50061", "[fd00::5]"),  # an IPv6 literal gets its brackets
        ("[fd00::5]:50061", "[fd00::5]"),
    ],
)
def test_the_steps_socket_advertises_the_nodes_host_and_its_bound_port(advertise: str, host: str) -> None:
    async def main() -> None:
        fe, address = await start_steps_front(object(), _opts(advertise_address=advertise))
        try:
            assert fe.port > 0
            assert address == f"{host}:{fe.port}"
        finally:
            await fe.stop()

    asyncio.run(main())
