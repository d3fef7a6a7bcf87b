"""Tensor parallelism in the engine: this process is TP rank 0, ranks 1..N-1 are workers.

Every rank holds the whole model with its share of the heads (``pdserve.models.llama``); the
ranks meet in the row-parallel all-reduces (gloo on CPU, NCCL on CUDA). The scheduler runs on
rank 0 only: each step it launches is sent to the workers as ``ExecuteStep`` first
(``pdserve.engine.workers``), and they launch the same step the same way. Sampling agrees
because every rank computes the same full logits (replicated lm_head) and the same generators:
seeded requests draw from a generator per request, unseeded ones from the default generator
seeded with ``EngineConfig.seed`` on every rank. Workers never answer a step; rank 0 samples,
and a worker that fails reports it and exits, raised as ``TPWorkerError`` at the next command.

    rank 0 (engine core)                     rank r (worker process)
    sched = scheduler.schedule()
    --pipe: ExecuteStep(sched, ...) ------>  launch(sched, ...)
    launch(sched, ...)                              |
        model forward  <=== all_reduce ===>  model forward, sample (dropped)
"""

from __future__ import annotations

import time

import torch

from pdserve.config.engine import CacheSizes, EngineConfig
from pdserve.distributed.parallel_state import destroy_tp, init_tp
from pdserve.distributed.pp_stage import KVWorkers, StageEndpoint
from pdserve.distributed.workers import TPWorkerError, WorkerGroup
from pdserve.engine.kv_workers import WorkerKV
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.pending_step import PendingStep
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.engine.workers import (
    DropFinished,
    ExecuteStep,
    InitKVCache,
    SizeKVCache,
    WorkerRole,
    WorkerSpec,
    worker_main,
)
from pdserve.kvoffload.spec import KVOffloadSpec
from pdserve.kvoffload.stages import InitKVOffload, StoreKVBlocks, ask_stages, block_bytes_of
from pdserve.models.config import IntermediateTensors, ModelArchConfig
from pdserve.models.llama import check_tp_divisible


class TPModelRunner(WorkerKV, ModelRunner, KVWorkers):
    """Rank 0's ``ModelRunner``: every call that runs the model is sent to the workers first.
    With KV transfer every rank registers its own KV (its share of the heads) and writes its own
    head slices on command, as pipeline stages do (``KVWorkers``)."""

    def __init__(self, config: EngineConfig, group_timeout_s: float = 300.0) -> None:
        world = config.parallel.tensor_parallel_size
        # Checked before any process starts, so a bad size fails fast with the fix.
        check_tp_divisible(ModelArchConfig.from_model_dir(config.model), world)
        spec = WorkerSpec(config, WorkerRole.TP_RANK, world, group_timeout_s=group_timeout_s)
        self.workers = WorkerGroup(
            world, WorkerRole.TP_RANK.value, TPWorkerError, worker_main, (spec,), config.device, True
        )
        self._init_worker_kv()
        self._last: PendingStep | None = None  # the last step launched (is it read yet?)
        try:
            init_tp(world, 0, self.workers.init_method, self.workers.backend, group_timeout_s)
            torch.manual_seed(config.seed)  # unseeded sampling draws the same on every rank
            super().__init__(config)
        except BaseException:
            self.workers.close()
            destroy_tp()
            raise

    def determine_cache_sizes(self) -> CacheSizes:
        self.workers.broadcast(SizeKVCache())  # every rank takes the smallest budget
        return super().determine_cache_sizes()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.workers.broadcast(InitKVCache(num_blocks), replies_from=self.workers.ranks)
        super().init_kv_cache(num_blocks)
        for rank in self.workers.ranks:
            self.workers.recv(rank, self.config.step_timeout_s)

    def launch(
        self,
        sched: SchedulerOutput,
        intermediate: IntermediateTensors | None = None,
        *,
        defer_masks: bool = False,
    ) -> PendingStep:
        overlaps = self._last is not None and not self._last.taken
        self.workers.broadcast(ExecuteStep(sched, defer_masks, overlaps))
        try:
            self._last = pending = super().launch(sched, intermediate, defer_masks=defer_masks)
        except RuntimeError:  # a collective whose peer rank died: name the rank
            self._raise_if_rank_died()
            raise
        return pending

    def _raise_if_rank_died(self, wait_s: float = 2.0) -> None:
        """TPWorkerError naming a worker rank whose process is gone (waiting up to ``wait_s``
        for a dying one to be reaped); returns if every rank lives."""
        deadline = time.monotonic() + wait_s
        while True:
            self.workers.check_alive()
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def drop_finished(self, request_ids: list[str]) -> None:
        super().drop_finished(request_ids)
        if request_ids:
            self.workers.broadcast(DropFinished(request_ids))

    def start_kv_endpoints(self, kv_transport: str, kv_host: str) -> list[StageEndpoint]:
        world = self.workers.world
        layers = self.arch.num_hidden_layers
        return [
            StageEndpoint(0, 1, 0, layers, session, regions, tp_rank=rank, tp_size=world, worker=rank)
            for rank, session, regions in self._register_workers(
                kv_transport, kv_host, self.config.step_timeout_s
            )
        ]

    def offload_runner(self) -> ModelRunner:
        return self

    def offload_widths(self) -> list[int]:
        """Every rank holds the same share of the KV heads (checked when each maps the pool)."""
        return [block_bytes_of(self)] * self.workers.world

    def init_stage_offload(self, msg: InitKVOffload) -> None:
        ask_stages(self.workers, msg, self.config.step_timeout_s)

    def store_on_stages(self, spec: KVOffloadSpec) -> None:
        """Every rank runs ``spec``'s stores now (ranks answer nothing else on their pipes)."""
        ask_stages(self.workers, StoreKVBlocks(spec), self.config.step_timeout_s)

    def check_alive(self) -> None:
        """Raise TPWorkerError naming a worker rank whose process is gone."""
        self.workers.check_alive()

    def close(self) -> None:
        super().close()
        self.workers.close()
        destroy_tp()
