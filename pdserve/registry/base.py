"""The registry interface and its entry (what a node says about itself)."""

from __future__ import annotations

import abc
import json
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Literal

from pdserve.errors import PdserveError

if TYPE_CHECKING:
    from pdserve.config.cluster import ClusterConfig

NodeState = Literal["serving", "draining"]


class RegistryUnavailableError(PdserveError):
    """The registry (Redis) cannot be reached; callers keep their last known node set."""


@dataclass(frozen=True)
class NodeEntry:
    name: str  # the node's name in the cluster file (one entry per name)
    role: str  # prefill | decode | colocated | encoder
    address: str  # host:port of its gRPC server, as the router dials it
    epoch: str  # random per process start; a new epoch replaces the old entry
    stages: int = 1  # pipeline stages behind this address (the node's `pp`)
    state: NodeState = "serving"  # draining: finishing in-flight work, takes no new requests

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> NodeEntry:
        d = json.loads(text)
        return cls(
            name=str(d["name"]),
            role=str(d["role"]),
            address=str(d["address"]),
            epoch=str(d["epoch"]),
            stages=int(d.get("stages", 1)),
            state="draining" if d.get("state") == "draining" else "serving",
        )

    def draining(self) -> NodeEntry:
        return replace(self, state="draining")


class NodeRegistry(abc.ABC):
    """Where the router learns the node set. Every method may raise RegistryUnavailableError.

    ``dynamic`` says whether the set can change while the router runs (whether polling
    ``list_nodes`` is worth it). Registration methods mutate only this node's own entry.
    """

    dynamic: bool = False

    @abc.abstractmethod
    async def list_nodes(self) -> list[NodeEntry]:
        """Every live entry (serving and draining), in name order."""

    @abc.abstractmethod
    async def register(self, entry: NodeEntry) -> None:
        """Write ``entry`` (replacing any entry of the same name, whatever its epoch)."""

    @abc.abstractmethod
    async def heartbeat(self, entry: NodeEntry) -> bool:
        """Refresh ``entry``'s TTL; False if another epoch now owns the name (we were replaced)."""

    @abc.abstractmethod
    async def deregister(self, entry: NodeEntry) -> None:
        """Remove ``entry`` if it is still ours (same epoch); a newer epoch's entry stays."""

    async def close(self) -> None:  # noqa: B027 (optional hook)
        """Release connections."""


def registry_for(cluster: ClusterConfig) -> NodeRegistry:
    """Redis when the cluster file sets ``redis_url``, else the file's own node list."""
    if cluster.redis_url:
        from pdserve.registry.redis_registry import RedisRegistry

        return RedisRegistry(cluster.redis_url, ttl_s=cluster.registry_ttl_s)
    from pdserve.registry.static import StaticRegistry

    return StaticRegistry(cluster)
