"""A decode or colocated node's Steps socket (services/steps_socket.py) from its settings: the
``frontend_port`` it refuses at start, and the :class:`StepsFront` it starts with the address
that ``LoadReport.steps_socket`` advertises. ``NodeBase`` (services/node.py) calls both."""

from __future__ import annotations

import logging
from typing import Any

from pdserve.config.choices import Role
from pdserve.config.node_spec import NodeSpec
from pdserve.errors import ConfigError
from services.steps_socket import StepsFront

logger = logging.getLogger(__name__)


def check_frontend_port(opts: NodeSpec) -> None:
    """ConfigError for a ``frontend_port`` on a prefill node, or one equal to the node's grpc or
    metrics port."""
    if opts.frontend_port is not None:
        if opts.role is Role.PREFILL:
            raise ConfigError(
                f"frontend_port {opts.frontend_port} on prefill node {opts.name}: a prefill node "
                "serves no Steps streams; set it on decode or colocated nodes only"
            )
        if opts.frontend_port and opts.frontend_port in (opts.grpc_port, opts.metrics_port):
            raise ConfigError(
                f"frontend_port {opts.frontend_port} of node {opts.name} is also its grpc or "
                "metrics port: give it a distinct port"
            )


async def start_steps_front(servicer: Any, opts: NodeSpec) -> tuple[StepsFront, str]:
    """The Steps socket on ``frontend_port`` (None or 0: any free port) and its address (the
    advertised host, the bound port); returns once it listens, raises OSError naming the port
    if it cannot."""
    fe = StepsFront(
        servicer,
        opts.host,
        opts.frontend_port or 0,
        opts.shared_token,
        hello_timeout_s=opts.steps_hello_timeout_s,
        max_pending_per_peer=opts.steps_max_pending_per_peer,
    )
    await fe.start()
    host = (opts.advertise_address or f"{opts.host}:{opts.grpc_port}").rsplit(":", 1)[0]
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 literal
    steps_socket = f"{host}:{fe.port}"
    logger.info("node %s: Steps socket on %s", opts.name, steps_socket)
    return fe, steps_socket
