"""Router side of the node registry: keep PDBackend's node lists equal to the registry's serving set.

Static registry (no ``redis_url``): the lists come from the cluster file once and never change.
Redis: refreshed every ``interval_s``; a node whose entry expired, or that marks itself draining,
leaves rotation at the next refresh; a node registered under a new address gets a new channel.
When Redis cannot be reached the last known set keeps serving (logged once per outage).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from pdserve.config.cluster import ClusterConfig
from pdserve.registry.base import NodeEntry, NodeRegistry, RegistryUnavailableError
from services.router.nodes import NodeHandle
from services.router.pd_backend import PDBackend

logger = logging.getLogger(__name__)

# The router's two lists, by the role a registry entry carries (colocated nodes decode).
LIST_OF_ROLE = {"prefill": "prefill", "decode": "decode", "colocated": "decode"}


def handles_from(entries: list[NodeEntry]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(prefill, decode) as PDBackend's constructor takes them: serving entries only."""
    serving = [e for e in entries if e.state == "serving"]
    prefill = [(e.name, e.address) for e in serving if LIST_OF_ROLE.get(e.role) == "prefill"]
    decode = [(e.name, e.address) for e in serving if LIST_OF_ROLE.get(e.role) == "decode"]
    return prefill, decode


class NodeDiscovery:
    """Polls ``registry`` and rewrites ``backend.prefill`` / ``backend.decode`` in place."""

    def __init__(
        self, registry: NodeRegistry, backend: PDBackend, cluster: ClusterConfig, interval_s: float
    ) -> None:
        assert interval_s > 0
        self.registry = registry
        self.backend = backend
        self.interval_s = interval_s
        self._known = {n.name: n.role for n in cluster.nodes}  # only the file's nodes may join
        self._retired: list[NodeHandle] = []  # left rotation with requests still on them
        self._reachable = True
        self._ignored: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for h in self._retired:
            await h.channel.close()
        await self.registry.close()

    async def refresh(self) -> bool:
        """One poll; False when the registry was unreachable (the node set is left as it was)."""
        try:
            entries = await self.registry.list_nodes()
        except RegistryUnavailableError as e:
            if self._reachable:
                logger.warning("node registry unreachable; routing to the last known nodes: %s", e)
            self._reachable = False
            return False
        if not self._reachable:
            logger.info("node registry reachable again")
        self._reachable = True
        await self.apply(entries)
        return True

    async def apply(self, entries: list[NodeEntry]) -> None:
        accepted = []
        for e in entries:
            if self._known.get(e.name) != e.role:
                if e.name not in self._ignored:  # a stranger or a role change: the file decides
                    logger.warning(
                        "registry entry %s (role %s) ignored: the cluster file has %s",
                        e.name,
                        e.role,
                        f"role {self._known[e.name]}" if e.name in self._known else "no such node",
                    )
                    self._ignored.add(e.name)
                continue
            accepted.append(e)
        prefill, decode = handles_from(accepted)
        self._reconcile(self.backend.prefill, prefill, "prefill")
        self._reconcile(self.backend.decode, decode, "decode")
        still = []
        for h in self._retired:
            if h.in_flight == 0:
                await h.channel.close()
            else:
                still.append(h)
        self._retired = still

    def _reconcile(self, current: list[NodeHandle], wanted: list[tuple[str, str]], role: str) -> None:
        by_key = {(h.name, h.address): h for h in current}
        new: list[NodeHandle] = []
        for name, addr in wanted:
            h = by_key.pop((name, addr), None)
            if h is None:
                h = self.backend.new_handle(name, addr, role)
                logger.info("node %s (%s) joined rotation at %s", name, role, addr)
            new.append(h)
        for h in by_key.values():
            logger.info("node %s (%s at %s) left rotation", h.name, role, h.address)
            self._retired.append(h)
        current[:] = new  # in place: the backend's poller and picker read these lists

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.refresh()


def discovery_interval_s(cluster: ClusterConfig) -> float:
    """A quarter TTL (at most 1 s): a dead node leaves rotation at most this long after its key expires."""
    return min(1.0, cluster.registry_ttl_s / 4)
