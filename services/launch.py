"""Start one node process from its options (``pdserve serve`` calls this)."""

from __future__ import annotations

import asyncio
import logging
import sys

from pdserve.errors import ConfigError
from services.node import NodeBase, NodeOptions

logger = logging.getLogger(__name__)


def build_node(opts: NodeOptions) -> NodeBase:
    if opts.role == "prefill":
        from services.prefill.server import PrefillNode

        return PrefillNode(opts)
    if opts.role in ("decode", "colocated"):
        from services.decode.server import DecodeNode

        return DecodeNode(opts)
    raise ValueError(f"unknown node role {opts.role!r}: prefill | decode | colocated")


EXIT_STARTUP_FAILED = 71  # EX_OSERR: a port could not be bound (logged as one line)
EXIT_CONFIG_REFUSED = 78  # EX_CONFIG: a setting the node refuses at start (logged as one line)


def run_node(opts: NodeOptions) -> None:
    try:
        node = build_node(opts)
    except ConfigError as e:  # e.g. Mooncake's ports on a non-loopback address (kvtransfer/exposure.py)
        logger.critical("node %s refuses to start: %s", opts.name, e)
        sys.exit(EXIT_CONFIG_REFUSED)
    try:
        asyncio.run(node.serve())
    except OSError as e:  # a port in use, an address not bindable: one line, not a traceback
        logger.critical("node %s cannot start: %s", opts.name, e)
        sys.exit(EXIT_STARTUP_FAILED)
    if node.exit_code:
        logger.critical("node %s exits with %d (engine died)", opts.name, node.exit_code)
        sys.exit(node.exit_code)
