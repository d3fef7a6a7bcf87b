"""Pipeline parallelism in the engine: stage 0 in this process, stages 1..N-1 as workers.

The layout, the stage links and the node's view are in ``pdserve.distributed.pp_stage``; the
commands and the stage's loop in ``pdserve.engine.workers``. Steps run synchronously: stage 0's
forward, then the last stage's ``StepResult``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from pdserve.config.engine import CacheSizes, EngineConfig
from pdserve.distributed.pp_stage import (
    STAGE_WRITE_TIMEOUT_S,
    PipelineRunner,
    PipelineStageError,
    StageEndpoint,
)
from pdserve.distributed.workers import WorkerGroup
from pdserve.engine.model_runner import ModelRunner, PendingStep, RunnerOutput
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.engine.workers import (
    DropFinished,
    ExecuteStep,
    InitKVCache,
    KVEndpoint,
    RegisterKV,
    StepResult,
    WorkerRole,
    WorkerSpec,
    WriteFailed,
    WriteKV,
    send_tensors,
    worker_main,
)
from pdserve.kvtransfer.backend import TransferError
from pdserve.kvtransfer.regions import Descriptor, Region
from pdserve.kvtransfer.topology import split_layers
from pdserve.models.config import IntermediateTensors, ModelArchConfig


def stage_ranges(config: EngineConfig) -> list[tuple[int, int]]:
    """The layer range of every stage of this engine (ConfigError naming the values if unsplittable)."""
    arch = ModelArchConfig.from_model_dir(config.model)
    par = config.parallel
    return split_layers(arch.num_hidden_layers, par.pipeline_parallel_size, par.pp_layer_split)


class _DoneStep(PendingStep):
    """A step already computed end to end (PP runs synchronously): ``result()`` returns it."""

    def __init__(self, out: RunnerOutput) -> None:
        super().__init__(req_ids=[], samples=None, event=None)
        self.out = out

    def result(self) -> RunnerOutput:
        self.taken = True
        return self.out


class PipelineExecutor(PipelineRunner):
    """Drop-in for ``ModelRunner`` in the engine core when ``pipeline_parallel_size`` > 1."""

    def __init__(self, config: EngineConfig, group_timeout_s: float = 300.0) -> None:
        self.ranges = stage_ranges(config)  # before any process starts: a bad pp fails fast
        world = len(self.ranges)
        self._timeout_s = config.step_timeout_s
        self._xlocks = [threading.Lock() for _ in range(world - 1)]
        spec = WorkerSpec(config, WorkerRole.PP_STAGE, world, tuple(self.ranges), group_timeout_s)
        self.workers = WorkerGroup(
            world, WorkerRole.PP_STAGE.value, PipelineStageError, worker_main, (spec,), config.device, True
        )
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
        self.workers.broadcast(InitKVCache(num_blocks))
        self.workers.gather(self._timeout_s)

    def start_kv_endpoints(self, kv_transport: str, kv_host: str) -> list[StageEndpoint]:
        self.workers.broadcast(RegisterKV(kv_transport, kv_host))
        out = []
        for rank, reply in enumerate(self.workers.gather(self._timeout_s), start=1):
            assert isinstance(reply, KVEndpoint), reply
            lo, hi = self.ranges[rank]
            regions = tuple(Region.from_dict(r) for r in reply.regions)
            out.append(StageEndpoint(rank, self.num_stages, lo, hi, reply.session, regions))
        return out

    def stage_write(
        self, rank: int, peer_session: str, descs: Sequence[Descriptor], transfer_id: str
    ) -> None:
        with self._xlocks[rank - 1]:
            msg = WriteKV(peer_session, list(descs), transfer_id)
            reply = self.workers.request(rank, msg, STAGE_WRITE_TIMEOUT_S, "finish a KV write")
        if isinstance(reply, WriteFailed):
            raise TransferError(
                peer_session, transfer_id, f"write from pipeline stage {rank}", None, reply.error
            )

    def launch(self, sched: SchedulerOutput, intermediate: IntermediateTensors | None = None) -> _DoneStep:
        assert intermediate is None
        self.workers.broadcast(ExecuteStep(sched))
        out = self.stage0.launch(sched).result()
        assert out.intermediate is not None
        try:
            send_tensors(out.intermediate, 1)
        except RuntimeError as e:  # gloo/NCCL: the peer stage is gone
            time.sleep(0.2)  # let the dead process be reaped so the error names it
            self.check_alive()
            raise PipelineStageError(f"sending hidden states to pipeline stage 1 failed: {e}") from e
        res = self.workers.recv(self.num_stages - 1, self._timeout_s)
        assert isinstance(res, StepResult), res
        return _DoneStep(RunnerOutput(res.sampled, res.logprobs, prompt_logprobs=res.prompt_logprobs))

    def drop_finished(self, request_ids: list[str]) -> None:
        self.stage0.drop_finished(request_ids)
        if request_ids:
            self.workers.broadcast(DropFinished(request_ids))

    def check_alive(self) -> None:
        self.workers.check_alive()

    def stage_pids(self) -> list[int]:
        return self.workers.pids()

    def close(self) -> None:
        if getattr(self, "stage0", None) is not None:
            self.stage0.close()
        self.workers.close()
        if dist.is_initialized():
            dist.destroy_process_group()
