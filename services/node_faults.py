"""An engine node's test-only faults: ``faults.engine_death_on_sigusr1`` kills the engine thread
and ``faults.engine_stall_on_sigusr2_s`` holds it in one command, each on its signal, so tests
and bench/chaos.py can drive the node's death and watchdog paths. ``NodeBase.serve``
(services/node.py) installs the signal handlers; ``NodeBase.inject_engine_death`` and
``inject_engine_stall`` call these."""

from __future__ import annotations

import logging
import time

from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


class InjectedEngineFault(BaseException):
    """Raised on the engine thread by ``faults.engine_death_on_sigusr1``: a BaseException, so the
    thread's command guard (which catches Exception) lets it through and the thread dies."""


def inject_engine_death(node_name: str, engine_loop: EngineLoop) -> None:
    """Kill the engine thread now (its next command raises :class:`InjectedEngineFault`)."""
    logger.warning("node %s: injected engine death (faults.engine_death_on_sigusr1)", node_name)

    def die(_engine: LLMEngine) -> None:
        raise InjectedEngineFault("injected engine death (faults.engine_death_on_sigusr1)")

    engine_loop.post(die)


def inject_engine_stall(node_name: str, engine_loop: EngineLoop, stall_s: float) -> None:
    """Hold the engine thread in one command ``stall_s`` long, as a wedged step would (the
    engine watchdog's case)."""
    logger.warning(
        "node %s: injected engine stall of %g s (faults.engine_stall_on_sigusr2_s)",
        node_name,
        stall_s,
    )
    engine_loop.post(lambda _engine: time.sleep(stall_s))
