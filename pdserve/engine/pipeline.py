"""Pipeline parallelism in the engine: stage 0 in this process, stages 1..N-1 as workers.

The layout, the stage links and the node's view are in ``pdserve.distributed.pp_stage``; the
commands and the stage's loop in ``pdserve.engine.workers``. A step is stage 0's forward, sent on
to stage 1, and the last stage's ``StepResult``; under asynchronous scheduling the engine
processes step N while stages 1..N-1 compute step N+1 (stage 0 needs step N's samples first).
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from pdserve.config.engine import CacheSizes, EngineConfig
from pdserve.distributed.pp_stage import (
    PipelineRunner,
    PipelineStageError,
    StageEndpoint,
)
from pdserve.distributed.workers import WorkerGroup
from pdserve.engine.kv_workers import WorkerKV
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.pending_step import PendingStep, RunnerOutput
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.engine.workers import (
    DropFinished,
    ExecuteStep,
    InitKVCache,
    StepResult,
    WorkerRole,
    WorkerSpec,
    send_tensors,
    worker_main,
)
from pdserve.kvoffload.spec import KVOffloadSpec
from pdserve.kvoffload.stages import InitKVOffload, StoreKVBlocks, ask_stages, stage_block_bytes
from pdserve.kvtransfer.topology import split_layers
from pdserve.models.config import IntermediateTensors, ModelArchConfig


def stage_ranges(config: EngineConfig) -> list[tuple[int, int]]:
    """The layer range of every stage of this engine (ConfigError naming the values if unsplittable)."""
    arch = ModelArchConfig.from_model_dir(config.model)
    par = config.parallel
    return split_layers(arch.num_hidden_layers, par.pipeline_parallel_size, par.pp_layer_split)


class _PipelineStep(PendingStep):
    """A step whose stage 0 ran; ``result()`` reads the last stage's ``StepResult`` (the
    executor reads it first when the next step's stage 0 needs its samples)."""

    def __init__(self, executor: PipelineExecutor) -> None:
        super().__init__(req_ids=[], samples=None, event=None)
        self._executor = executor
        self.out: RunnerOutput | None = None

    def receive(self) -> RunnerOutput:
        if self.out is None:
            res = self._executor.workers.recv(self._executor.num_stages - 1, self.timeout_s)
            assert isinstance(res, StepResult), res
            self.out = RunnerOutput(res.sampled, res.logprobs, prompt_logprobs=res.prompt_logprobs)
        return self.out

    def result(self) -> RunnerOutput:
        self.taken = True
        return self.receive()


class PipelineExecutor(WorkerKV, PipelineRunner):
    """Drop-in for ``ModelRunner`` in the engine core when ``pipeline_parallel_size`` > 1."""

    def __init__(self, config: EngineConfig, group_timeout_s: float = 300.0) -> None:
        self.ranges = stage_ranges(config)  # before any process starts: a bad pp fails fast
        world = len(self.ranges)
        self._timeout_s = config.step_timeout_s
        self._last: _PipelineStep | None = None  # the last step launched (is it read yet?)
        spec = WorkerSpec(config, WorkerRole.PP_STAGE, world, tuple(self.ranges), group_timeout_s)
        self.workers = WorkerGroup(
            world, WorkerRole.PP_STAGE.value, PipelineStageError, worker_main, (spec,), config.device, True
        )
        self._init_worker_kv()
        try:
            dist.init_process_group(
                self.workers.backend,
                init_method=self.workers.init_method,
                world_size=world,
                rank=0,
                timeout=timedelta(seconds=group_timeout_s),
            )
            self.stage0 = ModelRunner(config, *self.ranges[0])
        except BaseException:
            self.close()
            raise
        self.config = config
        self.arch = self.stage0.arch
        self.device = self.stage0.device
        self.dtype = self.stage0.dtype
        self.block_size = self.stage0.block_size
        self.model = self.stage0.model  # stage 0's slice: not a whole model

    @property
    def kv_cache(self) -> torch.Tensor | None:
        return self.stage0.kv_cache

    def determine_cache_sizes(self) -> CacheSizes:
        """Stage 0's sizing; every stage allocates that many blocks for its own layers (with the
        default even split stage 0 holds the most layers, so no stage exceeds the budget)."""
        return self.stage0.determine_cache_sizes()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.stage0.init_kv_cache(num_blocks)
        self.workers.ask_all(InitKVCache(num_blocks), self._timeout_s)

    def start_kv_endpoints(self, kv_transport: str, kv_host: str) -> list[StageEndpoint]:
        return [
            StageEndpoint(rank, self.num_stages, *self.ranges[rank], session, regions, worker=rank)
            for rank, session, regions in self._register_workers(kv_transport, kv_host, self._timeout_s)
        ]

    def launch(
        self,
        sched: SchedulerOutput,
        intermediate: IntermediateTensors | None = None,
        *,
        defer_masks: bool = False,
    ) -> _PipelineStep:
        """Stage 0's forward of ``sched``, sent on to stage 1; the result comes from the last stage.

        Under asynchronous scheduling the step before may still be unread: its samples are the
        inputs of rows whose token is in flight, so they are read here first (the engine then
        processes that step while stages 1..N-1 compute this one)."""
        assert intermediate is None
        prev, stage0 = self._last, self.stage0
        overlaps = prev is not None and not prev.taken
        self.workers.broadcast(ExecuteStep(sched, overlaps=overlaps), replies_from=[self.num_stages - 1])
        if prev is not None and overlaps:
            sampled = prev.receive().sampled
            stage0._prev_rows = {rid: i for i, rid in enumerate(sampled)}
            stage0._prev_sampled = torch.tensor(list(sampled.values()), dtype=torch.int64, device=self.device)
        out = stage0.launch(sched).result()
        assert out.intermediate is not None
        try:
            send_tensors(out.intermediate, 1)
        except RuntimeError as e:  # gloo/NCCL: the peer stage is gone
            time.sleep(0.2)  # let the dead process be reaped so the error names it
            self.check_alive()
            raise PipelineStageError(f"sending hidden states to pipeline stage 1 failed: {e}") from e
        self._last = step = _PipelineStep(self)
        step.timeout_s = self._timeout_s
        return step

    def offload_runner(self) -> ModelRunner:
        return self.stage0

    def offload_widths(self) -> list[int]:
        return stage_block_bytes(self.stage0, self.ranges)

    def init_stage_offload(self, msg: InitKVOffload) -> None:
        """Every stage maps the offload tier's shared host pool."""
        ask_stages(self.workers, msg, self._timeout_s)

    def store_on_stages(self, spec: KVOffloadSpec) -> None:
        """Every stage runs ``spec``'s stores now (the last step's result is read first: it
        comes on the same pipe as the answers)."""
        if self._last is not None:
            self._last.receive()
        ask_stages(self.workers, StoreKVBlocks(spec), self._timeout_s)

    def drop_finished(self, request_ids: list[str]) -> None:
        self.stage0.drop_finished(request_ids)
        if request_ids:
            self.workers.broadcast(DropFinished(request_ids))

    def check_alive(self) -> None:
        self.workers.check_alive()

    def close(self) -> None:
        if getattr(self, "stage0", None) is not None:
            self.stage0.close()
        self.workers.close()
        if dist.is_initialized():
            dist.destroy_process_group()
