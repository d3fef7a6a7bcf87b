"""The watchdog of a node's worker processes: a node is healthy only while every pipeline stage,
TP rank and PCP rank process is (docs/design.md §7).

Every ``STAGE_WATCH_S`` it asks the runner whether its workers live; once one is gone the node
turns NOT_SERVING, fails every in-flight request with the reason, and stops with exit code 1 (a
prefill's held KV is then freed by the peer's lease on decode). A live engine thread stuck in
one step is services/engine_watchdog.py's case; a dead engine thread is ``NodeBase``'s
(services/node.py). ``NodeBase.serve`` runs this one on nodes with worker processes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

from grpc_health.v1 import health_pb2

from pdserve.distributed.pp_stage import KVWorkers
from pdserve.distributed.workers import WorkerError
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm_engine import LLMEngine
from pdserve.pcp.runner import PCPModelRunner

logger = logging.getLogger(__name__)
STAGE_WATCH_S = 0.5  # how often the node checks that its pipeline stage processes live


class StageWatchdog:
    def __init__(
        self,
        node_name: str,
        runner: KVWorkers | PCPModelRunner,
        engine_loop: EngineLoop,
        health: Any,
        stop: Callable[[int], None],
    ) -> None:
        self.node_name = node_name
        self.runner = runner
        self.engine_loop = engine_loop
        self.health = health  # the node's grpc health servicer
        self.stop = stop  # stops the node; the process exits with the code it is given

    async def run(self) -> None:
        while True:
            await asyncio.sleep(STAGE_WATCH_S)
            try:
                self.runner.check_alive()
            except WorkerError as e:  # a pipeline stage, TP rank or PCP rank
                await self.out_of_service(str(e))
                return

    async def out_of_service(self, reason: str) -> None:
        """A process of this node died: NOT_SERVING, fail every request in flight, stop (exit 1)."""
        msg = f"node {self.node_name} is out of service: {reason}"
        logger.error("%s", msg)
        await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        self.engine_loop.post_and_dispatch(functools.partial(LLMEngine.fail_all, message=msg))
        await asyncio.sleep(STAGE_WATCH_S)  # let the failed deltas reach their streams
        self.stop(1)
