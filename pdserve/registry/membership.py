"""A node's side of the registry: register at start, heartbeat, mark draining, deregister.

Redis going away is logged, not fatal: the node keeps serving, and re-registers on the first
heartbeat that gets through (the key may have expired meanwhile).
"""

from __future__ import annotations

import asyncio
import logging

from pdserve.registry.base import NodeEntry, NodeRegistry, RegistryUnavailableError

logger = logging.getLogger(__name__)


class Membership:
    """Owns one node's entry; ``heartbeat_s`` is a third of the TTL, so two beats may be lost."""

    def __init__(self, registry: NodeRegistry, entry: NodeEntry, heartbeat_s: float) -> None:
        assert heartbeat_s > 0
        self.registry = registry
        self.entry = entry
        self.heartbeat_s = heartbeat_s
        self.replaced = False  # another process registered our name with a newer epoch
        self._task: asyncio.Task[None] | None = None
        self._reachable = True

    async def start(self) -> None:
        try:
            await self.registry.register(self.entry)
            logger.info("registered %s (%s at %s, epoch %s)", *self._who())
        except RegistryUnavailableError as e:
            self._set_reachable(False, e)
        self._task = asyncio.get_running_loop().create_task(self._beat())

    async def mark_draining(self) -> None:
        """The router stops sending new work on its next refresh; the entry stays until deregister."""
        self.entry = self.entry.draining()
        await self._beat_once()

    async def stop(self) -> None:
        """Stop heartbeating, deregister (unless replaced) and close the registry connection. A
        cancel of the caller is not swallowed: the connection is closed and the cancel goes on."""
        try:
            if self._task is not None:
                self._task.cancel()
                await asyncio.wait({self._task})  # the caller's own cancel propagates from here
            if self.replaced:
                return  # the name belongs to a newer epoch now: leave its entry alone
            try:
                await self.registry.deregister(self.entry)
                logger.info("deregistered %s (%s at %s, epoch %s)", *self._who())
            except RegistryUnavailableError as e:
                logger.warning("deregister failed (the entry expires within one TTL): %s", e)
        finally:
            await self.registry.close()

    async def _beat(self) -> None:
        while not self.replaced:
            await asyncio.sleep(self.heartbeat_s)
            await self._beat_once()

    async def _beat_once(self) -> None:
        if self.replaced:
            return
        try:
            ok = await self.registry.heartbeat(self.entry)
        except RegistryUnavailableError as e:
            self._set_reachable(False, e)
            return
        self._set_reachable(True, None)
        if not ok:
            self.replaced = True
            logger.error(
                "node %s was re-registered by another process (a newer epoch); this one (epoch %s) "
                "stops heartbeating and should be stopped",
                self.entry.name,
                self.entry.epoch,
            )

    def _set_reachable(self, ok: bool, err: Exception | None) -> None:
        # Log transitions only: a Redis outage must not flood the log once per beat.
        if ok and not self._reachable:
            logger.info("node registry reachable again; %s re-registered", self.entry.name)
        elif not ok and self._reachable:
            logger.warning("node registry unreachable, node keeps serving: %s", err)
        self._reachable = ok

    def _who(self) -> tuple[str, str, str, str]:
        e = self.entry
        return e.name, e.role, e.address, e.epoch
