"""What the engine core runs its steps on: one protocol, three implementations.

``LLMEngine`` talks to a ``ModelExecutor`` only: a plain ``ModelRunner`` (one process), a
``TPModelRunner`` (TP rank 0 here, ranks 1..N-1 as workers), a ``PipelineExecutor`` (stage 0
here, stages 1..N-1 as workers) or a ``PCPModelRunner`` (prefill context parallel rank 0 here,
``pdserve.pcp``); ``make_executor`` picks one from the parallel settings. The
asynchronous-scheduling calls for grammar rows (``prepare_deferred``, ``sample_deferred``) exist
on a ``ModelRunner`` only, since a pipeline's last stage samples in full.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pdserve.config.engine import CacheSizes, EngineConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.pending_step import PendingStep
from pdserve.engine.pipeline import PipelineExecutor
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.engine.tensor_parallel import TPModelRunner
from pdserve.models.config import ModelArchConfig
from pdserve.models.llama import LlamaForCausalLM


class ModelExecutor(Protocol):
    arch: ModelArchConfig
    device: torch.device
    dtype: torch.dtype
    block_size: int
    model: LlamaForCausalLM  # the whole model, or stage 0's slice of it

    @property
    def kv_cache(self) -> torch.Tensor | None: ...

    def determine_cache_sizes(self) -> CacheSizes: ...

    def init_kv_cache(self, num_blocks: int) -> None: ...

    def launch(self, sched: SchedulerOutput, *, defer_masks: bool = False) -> PendingStep: ...

    def drop_finished(self, request_ids: list[str]) -> None: ...

    def close(self) -> None: ...


def make_executor(config: EngineConfig) -> ModelExecutor:
    """The executor for ``config.parallel``: PP stage 0, TP rank 0, or the whole model here."""
    if config.parallel.pipeline_parallel_size > 1:
        return PipelineExecutor(config)
    if config.parallel.tensor_parallel_size > 1:
        return TPModelRunner(config)
    if config.parallel.prefill_context_parallel_size > 1:
        from pdserve.pcp.runner import PCPModelRunner

        return PCPModelRunner(config)
    return ModelRunner(config)
