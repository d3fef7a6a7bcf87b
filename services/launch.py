"""Start one node process from its options (``pdserve serve`` calls this)."""

from __future__ import annotations

import asyncio
import logging

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


def run_node(opts: NodeOptions) -> None:
    node = build_node(opts)
    asyncio.run(node.serve())
    if node.exit_code:  # e.g. a pipeline stage died: the node left service, exit non-zero
        raise SystemExit(node.exit_code)
