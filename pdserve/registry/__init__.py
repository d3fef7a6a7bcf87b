"""Node registry: who serves what, where, and since which start (epoch).

Two implementations behind one interface (:class:`~pdserve.registry.base.NodeRegistry`):
the static list of the cluster file, and Redis (``redis_url`` set), where nodes register under
a TTL and heartbeat. ``registry_for(cluster)`` picks one.
"""

from __future__ import annotations

from pdserve.registry.base import NodeEntry, NodeRegistry, RegistryUnavailableError, registry_for

__all__ = ["NodeEntry", "NodeRegistry", "RegistryUnavailableError", "registry_for"]
