"""What a speculative node's engine decides at start (LLMEngine and its StepLauncher call these).

- Speculative steps are synchronous: the drafts of step N+1 come from the tokens step N accepts,
  so nothing can be scheduled ahead. ``async_scheduling`` is off for a speculative node (a log
  line says so; an explicit ``async_scheduling: true`` is overridden with a warning).
- CUDA graphs stay captured for pure decode steps (every row one token: no row found a draft);
  a step with drafts has 1 + m tokens a row and runs eagerly (``CudaGraphRunner.can_run``).
- Speculation runs on one model runner: with TP ranks or pipeline stages it is refused at start.
"""

from __future__ import annotations

import logging

from pdserve.config.engine import EngineConfig
from pdserve.engine.executor import ModelExecutor
from pdserve.engine.model_runner import ModelRunner
from pdserve.errors import ConfigError
from pdserve.spec_decode.scheduling import SpecScheduling

logger = logging.getLogger(__name__)


def make_spec_scheduling(
    config: EngineConfig, runner: ModelExecutor, max_model_len: int
) -> SpecScheduling | None:
    spec = config.speculative
    if spec is None:
        return None
    p = config.parallel
    if p.tensor_parallel_size > 1 or p.pipeline_parallel_size > 1 or not isinstance(runner, ModelRunner):
        raise ConfigError(
            f"speculative decoding ({spec.method}) runs on one model runner; tensor_parallel_size="
            f"{p.tensor_parallel_size} and pipeline_parallel_size={p.pipeline_parallel_size} are not "
            "supported with it: use 1 for both or remove speculative"
        )
    logger.info(
        "speculative decoding: %s, %d draft tokens a step (%s); CUDA graphs only for steps without drafts",
        spec.method,
        spec.num_speculative_tokens,
        spec.drafter_identity,
    )
    return SpecScheduling(spec, max_model_len, runner.drafter)


def spec_async_scheduling(config: EngineConfig) -> bool:
    """Always False: see the module docstring."""
    if config.async_scheduling:
        logger.warning(
            "async_scheduling: true is turned off: speculative decoding schedules each step after the last"
        )
    else:
        logger.info("async scheduling off: speculative decoding schedules each step after the last")
    return False
