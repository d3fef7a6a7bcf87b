"""The offload tier on an engine of several processes: pipeline stages (each its layers) or TP
ranks (each its KV heads) copy their own share of every block.

One scheduler (process 0's) decides every store and load by block hash, as with one process;
the step's ``KVOffloadSpec`` travels to every process inside its ``SchedulerOutput``, and each
process's copier runs it against its own KV cache and its own columns of the shared host pool
(``shared_pool``). Budgets are the node's: ``cpu_bytes`` and ``disk_bytes`` hold whole blocks
(every layer, every head), split between the processes in proportion to their KV, so a budget
holds as many tokens as with one process.

Completion: a process other than 0 waits for its stores before its forward, so once step N
completed (the last stage's result read; rank 0's forward joined every rank's collectives) every
process's step-N stores are on the host; the scheduler side reads a stored row (to write it to
disk) only after its step completed (``KVOffloadManager(stores_complete_with_step=True)``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.distributed.workers import Ack, WorkerGroup
from pdserve.engine.model_runner import ModelRunner
from pdserve.kvoffload.copier import KVOffloadCopier
from pdserve.kvoffload.shared_pool import create_pool_file, map_pool, stage_columns
from pdserve.kvoffload.spec import KVOffloadSpec


@dataclass(frozen=True)
class InitKVOffload:
    """Map the shared host pool; stage i copies columns ``columns[i]`` (``[start, end)``) of its rows."""

    pool_path: str
    num_slots: int
    row_bytes: int
    columns: tuple[tuple[int, int], ...]
    timeout_s: float


@dataclass(frozen=True)
class StoreKVBlocks:
    """Run these stores now and answer (remote KV writes into the evicted blocks come next)."""

    spec: KVOffloadSpec


class StageGroup(Protocol):
    """An engine whose KV is split between processes: ``PipelineExecutor`` (each stage its
    layers) or ``TPModelRunner`` (each rank its KV heads)."""

    def offload_runner(self) -> ModelRunner: ...  # this process's (stage 0's, rank 0's)
    def offload_widths(self) -> list[int]: ...  # bytes of one block in each process, in rank order
    def init_stage_offload(self, msg: InitKVOffload) -> None: ...
    def store_on_stages(self, spec: KVOffloadSpec) -> None: ...


def ask_stages(workers: WorkerGroup, msg: InitKVOffload | StoreKVBlocks, timeout_s: float) -> None:
    """``msg`` to every worker process; each answers ``Ack`` once done."""
    for reply in workers.ask_all(msg, timeout_s):
        assert isinstance(reply, Ack), reply


def block_bytes_of(runner: ModelRunner) -> int:
    """Bytes of one block of ``runner``'s KV cache (its layers, its heads)."""
    assert runner.kv_cache is not None
    return runner.kv_cache[0].numel() * runner.kv_cache.element_size()


def stage_block_bytes(stage0: ModelRunner, ranges: list[tuple[int, int]]) -> list[int]:
    """Bytes of one block of each pipeline stage's layers (stage 0's from its KV cache; every
    layer holds the same bytes per block, which each stage checks when it maps the pool)."""
    row0 = block_bytes_of(stage0)
    start0, end0 = ranges[0]
    per_layer, rest = divmod(row0, end0 - start0)
    assert rest == 0, (row0, ranges[0])
    return [row0] + [per_layer * (end - start) for start, end in ranges[1:]]


def open_stage_pool(
    group: StageGroup, num_slots: int, timeout_s: float
) -> tuple[torch.Tensor, KVOffloadCopier]:
    """Create and map the shared pool in every stage; returns the whole pool and stage 0's copier."""
    widths, local = group.offload_widths(), group.offload_runner()
    row_bytes = sum(widths)
    columns = stage_columns(widths)
    path = create_pool_file(num_slots, row_bytes)
    try:
        pool = map_pool(path, num_slots, row_bytes, local.device)
        assert local.kv_cache is not None
        start0, end0 = columns[0]
        copier = KVOffloadCopier(local.kv_cache, num_slots, timeout_s, pool[:, start0:end0])
        group.init_stage_offload(InitKVOffload(path, num_slots, row_bytes, tuple(columns), timeout_s))
    finally:
        os.unlink(path)  # every stage mapped it (or failed): the mappings keep the memory
    return pool, copier


def stage_copier(msg: InitKVOffload, runner: ModelRunner, stage: int) -> KVOffloadCopier:
    """Stage ``stage``'s copier over its columns of the shared pool."""
    assert runner.kv_cache is not None, "InitKVOffload before InitKVCache"
    start, end = msg.columns[stage]
    row = block_bytes_of(runner)
    assert row == end - start, f"stage {stage}: a block of {row} bytes, pool columns of {end - start}"
    pool = map_pool(msg.pool_path, msg.num_slots, msg.row_bytes, runner.device)
    return KVOffloadCopier(runner.kv_cache, msg.num_slots, msg.timeout_s, pool[:, start:end])


def run_stage_copies(copier: KVOffloadCopier, spec: KVOffloadSpec) -> None:
    """A stage's copies of one step, before its forward; its stores are on the host on return."""
    num_blocks, num_slots = copier.kv_bytes.shape[0], copier.pool.shape[0]
    for block_id, slot in (*spec.stores, *spec.loads):
        assert 0 <= block_id < num_blocks and 0 <= slot < num_slots, (block_id, slot)
    copier.execute(spec)
    if spec.stores:
        copier.wait_stores()
