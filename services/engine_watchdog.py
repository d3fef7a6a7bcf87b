"""The engine thread's watchdog: a node whose engine is stuck in one step says so.

A step (or an engine command) that runs past ``step_timeout_s`` means the engine thread is
wedged (a hung native call, a runaway host loop): the node's gRPC health turns NOT_SERVING and
GetLoad answers UNAVAILABLE (the router takes the node out of rotation at its next poll, and
``/ready`` follows), and every open stream ends with an error from the event loop, since the
engine thread cannot end them. When the step does end, the node turns SERVING again: the engine
thread is alive and stepping, the streams it held are gone (their requests are aborted on the
engine as soon as it runs), and a node that stays wedged stays out; a node that only stalled
once comes back without a restart. A dead engine thread is handled elsewhere (the node exits).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from grpc_health.v1 import health_pb2

from pdserve.engine.engine_loop import EngineLoop

logger = logging.getLogger(__name__)
ENGINE_WATCH_S = 0.5  # how often the watchdog looks at most (a quarter of step_timeout_s if less)


class EngineWatchdog:
    def __init__(self, node_name: str, engine_loop: EngineLoop, step_timeout_s: float, health: Any) -> None:
        self.node_name = node_name
        self.engine_loop = engine_loop
        self.step_timeout_s = step_timeout_s
        self.health = health  # the node's grpc health servicer
        self.wedged = False  # the current step outlived step_timeout_s (GetLoad: UNAVAILABLE)
        self.num_wedged_total = 0

    @property
    def period_s(self) -> float:
        return min(ENGINE_WATCH_S, self.step_timeout_s / 4)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            await self.check()

    async def check(self) -> None:
        """One look: out of service when the current step outlived step_timeout_s, back in when
        it ended."""
        if not self.engine_loop.alive:
            return  # the node is exiting (EngineLoop's on_death)
        busy_s = self.engine_loop.busy_s()
        if busy_s > self.step_timeout_s and not self.wedged:
            self.wedged = True
            self.num_wedged_total += 1
            msg = (
                f"node {self.node_name}: its engine thread has been in one step for {busy_s:.1f} s, "
                f"past step_timeout_s={self.step_timeout_s:g} s; the node is out of service, retry elsewhere"
            )
            logger.error("%s", msg)
            self.engine_loop.wedged = msg
            await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            # streams end with a retryable error now: the stuck step cannot end them
            failed = self.engine_loop.fail_streams(msg)
            logger.error("node %s: ended %d streams of the wedged engine", self.node_name, len(failed))
        elif self.wedged and busy_s <= self.step_timeout_s:
            self.wedged = False
            self.engine_loop.wedged = None
            logger.warning("node %s: the engine thread's step ended; SERVING again", self.node_name)
            await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
