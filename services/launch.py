"""Start one engine node process from its :class:`~pdserve.config.node_spec.NodeSpec`
(``pdserve serve`` calls this): the node (its connectors, engine, front end), then serve."""

from __future__ import annotations

import asyncio
import logging
import sys

from pdserve.config.choices import Role
from pdserve.config.node_spec import NodeSpec
from pdserve.errors import ConfigError
from services.gc_heap import freeze_startup_heap
from services.node import NodeBase

logger = logging.getLogger(__name__)


def build_node(opts: NodeSpec) -> NodeBase:
    if opts.role is Role.PREFILL:
        from services.prefill.server import PrefillNode

        return PrefillNode(opts)
    assert opts.role.decodes, f"an engine node is prefill, decode or colocated, not {opts.role}"
    from services.decode.server import DecodeNode

    return DecodeNode(opts)


EXIT_STARTUP_FAILED = 71  # EX_OSERR: a port could not be bound (logged as one line)
EXIT_CONFIG_REFUSED = 78  # EX_CONFIG: a setting the node refuses at start (logged as one line)


def run_node(opts: NodeSpec) -> None:
    try:
        node = build_node(opts)
    except ConfigError as e:  # e.g. Mooncake's ports on a non-loopback address (kvtransfer/exposure.py)
        logger.critical("node %s refuses to start: %s", opts.name, e)
        sys.exit(EXIT_CONFIG_REFUSED)
    # engine, model and KV cache built: most of what the process keeps (services/gc_heap.py)
    freeze_startup_heap(f"{opts.role} node {opts.name}")
    try:
        asyncio.run(node.serve())
    except OSError as e:  # a port in use, an address not bindable: one line, not a traceback
        logger.critical("node %s cannot start: %s", opts.name, e)
        sys.exit(EXIT_STARTUP_FAILED)
    if node.exit_code:
        logger.critical("node %s exits with %d (engine died)", opts.name, node.exit_code)
        sys.exit(node.exit_code)
