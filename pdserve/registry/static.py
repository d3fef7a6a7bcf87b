"""The node set written in the cluster file: fixed for the router's lifetime."""

from __future__ import annotations

from pdserve.config.cluster import ClusterConfig
from pdserve.registry.base import NodeEntry, NodeRegistry


class StaticRegistry(NodeRegistry):
    """``list_nodes`` is the file's nodes; registration is a no-op (the file is the truth)."""

    dynamic = False

    def __init__(self, cluster: ClusterConfig) -> None:
        self._entries = [
            NodeEntry(name=n.name, role=n.role, address=n.grpc_address, epoch="", stages=n.pp)
            for n in sorted(cluster.nodes, key=lambda n: n.name)
        ]

    async def list_nodes(self) -> list[NodeEntry]:
        return list(self._entries)

    async def register(self, entry: NodeEntry) -> None:
        pass

    async def heartbeat(self, entry: NodeEntry) -> bool:
        return True

    async def deregister(self, entry: NodeEntry) -> None:
        pass
