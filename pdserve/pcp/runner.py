"""Prefill context parallelism in the engine: this process is PCP rank 0, ranks 1..N-1 are workers.

Every rank holds the whole model and a whole KV cache. The scheduler runs on rank 0 only; each
step it launches goes to the workers first (``ExecuteStep``, the TP protocol of
``pdserve.engine.workers``, served by ``pdserve.pcp.worker``), and every rank launches it the
same way. A long prompt chunk is split zig-zag over the ranks (``index_map``), each rank
computing its slice of the chunk through every layer, the K/V exchanged per layer
(``exchange``); every other row (decode, short prompts) is replicated. After the forward every
rank holds the sampled rows in global order and samples them (same generators as TP ranks:
seeded per request, or the default generator seeded with ``EngineConfig.seed``); rank 0's
tokens are the engine's, the workers' are dropped.

    rank 0 (engine core)                      rank r (worker process)
    sched = scheduler.schedule()
    --pipe: ExecuteStep(sched) ---------->   launch(sched)
    launch(sched)                               |
       each layer: store own K/V <=== all_gather K/V ===> store own K/V
       gather sampled rows       <=== all_gather ======> (rows it computed)
       sample                                   sample (dropped)

Decode after a PCP prefill is replicated on every rank (one token per request, no exchange), so
every rank's cache stays whole: a prefix hit may later split a chunk after that context.

Speculative decoding: rank 0 drafts (n-gram, a draft model, the MTP module's draft forwards) and
the drafts travel in ``ExecuteStep``'s SchedulerOutput; every rank verifies them on replicated
rows. A drafter with weights exists on every rank. An MTP module's KV is written after each step
from the target's hidden states, which a split chunk leaves spread over the ranks, so rank 0
sends ``DrafterAfterStep`` (the step's tokens) and every rank runs the module over its rows of
the step (``ContextParallel.run_split``), the module's K/V all-gathered. A draft model's first
catch-up over a long prompt is split the same way: rank 0 sends ``DraftForward`` (the rows) just
before its own part (spec_decode/draft_model.py); its other draft forwards run on rank 0 alone.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.config.engine import CacheSizes, EngineConfig
from pdserve.distributed.workers import WorkerError, WorkerGroup
from pdserve.engine.device import set_intra_op_threads
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.pending_step import PendingStep
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.engine.workers import DropFinished, ExecuteStep, InitKVCache, SizeKVCache
from pdserve.pcp.checks import check_pcp_config, rank_config
from pdserve.pcp.exchange import destroy_pcp_group, init_pcp_group
from pdserve.pcp.step import ContextParallel
from pdserve.spec_decode.drafter import DraftRow


class PCPWorkerError(WorkerError):
    """A prefill-context-parallel worker rank failed or exited."""


@dataclass(frozen=True)
class DrafterAfterStep:
    """Run the drafter's ``after_step`` on the step the worker ran last, with rank 0's tokens
    (its arguments: ``Drafter.after_step``); no reply. Sent where the drafter's ``after_step``
    calls ``after_step_peers`` (an MTP module: its KV is split as the target's)."""

    sampled: dict[str, int]
    spec_sampled: dict[str, list[int]]
    drafting_off: bool


@dataclass(frozen=True)
class DraftForward:
    """Run the drafter's forward over ``rows`` split over the ranks with rank 0
    (``Drafter.peer_forward``: a draft model's first catch-up over a long prompt); no reply."""

    rows: list[DraftRow]


class PCPRankRunner(ModelRunner):
    """The ``ModelRunner`` of one PCP rank (the process's group is already joined)."""

    def __init__(self, config: EngineConfig, rank: int, size: int) -> None:
        config = rank_config(config, rank)
        if config.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(config.device))  # NCCL's device for this rank
        self.pcp = ContextParallel(rank, size)  # before the runner makes its drafter (make_drafter)
        super().__init__(config)
        self.pcp_size = size

    def determine_cache_sizes(self) -> CacheSizes:
        """This rank's budget in blocks; every rank holds every block, so on the CPU the default
        budget (min(4 GiB, half of MemAvailable)) is shared by the host's ranks.
        ``kv_cache_memory_bytes`` and ``num_blocks_override`` are each rank's. Rank 0 takes the
        smallest of the ranks' (``PCPModelRunner``)."""
        sizes = super().determine_cache_sizes()
        cc = self.config.cache
        if self.device.type != "cpu" or cc.num_blocks_override is not None or cc.kv_cache_memory_bytes:
            return sizes
        num_blocks = max(1, sizes.num_blocks // self.pcp_size)
        return dataclasses.replace(
            sizes, num_blocks=num_blocks, budget_bytes=num_blocks * sizes.bytes_per_block
        )


class PCPModelRunner(PCPRankRunner):
    """Rank 0's runner: every call that runs the model is sent to the worker ranks first."""

    def __init__(self, config: EngineConfig) -> None:
        from pdserve.pcp.worker import PCPWorkerSpec, pcp_worker_main

        size = config.parallel.prefill_context_parallel_size
        check_pcp_config(config)  # before any process starts: a bad setting fails fast
        # joining the group and every collective of a step: a step's limit (step_timeout_s)
        group_timeout_s = config.step_timeout_s
        spec = PCPWorkerSpec(config, size, group_timeout_s)
        self.workers = WorkerGroup(size, "PCP rank", PCPWorkerError, pcp_worker_main, (spec,), config.device)
        try:
            init_pcp_group(size, 0, self.workers.init_method, self.workers.backend, group_timeout_s)
            set_intra_op_threads(config, size)  # the host's cores are shared by the ranks
            torch.manual_seed(config.seed)  # unseeded sampling draws the same on every rank
            super().__init__(config, 0, size)
            if self.drafter is not None:  # every rank holds it (make_drafter)
                self.drafter.after_step_peers = self._drafter_after_step
                self.drafter.split_peers = self._drafter_split_forward
        except BaseException:
            self.workers.close()
            destroy_pcp_group()
            raise

    def determine_cache_sizes(self) -> CacheSizes:
        """The smallest budget of the ranks: every rank must hold every block rank 0 schedules."""
        mine = super().determine_cache_sizes()
        theirs = self.workers.ask_all(SizeKVCache(), self.config.step_timeout_s)
        return min([mine, *theirs], key=lambda sizes: sizes.num_blocks)

    def init_kv_cache(self, num_blocks: int) -> None:
        self.workers.ask_all(InitKVCache(num_blocks), self.config.step_timeout_s)
        super().init_kv_cache(num_blocks)

    def launch(self, sched: SchedulerOutput, *args: Any, **kwargs: Any) -> PendingStep:
        """``ModelRunner.launch``, the workers told first (pp 1: no intermediate tensors)."""
        assert not args and kwargs.get("intermediate") is None, "PCP runs with pp 1"
        assert not sched.kv_loads, "PCP nodes pull no KV: pulled KV would reach rank 0's cache only"
        self.workers.broadcast(ExecuteStep(sched))
        with self._naming_lost_rank():
            return super().launch(sched, **kwargs)

    @contextmanager
    def _naming_lost_rank(self) -> Iterator[None]:
        """A collective that failed because a worker died raises PCPWorkerError naming it."""
        try:
            yield
        except RuntimeError:
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:  # a dying worker is reaped within moments
                self.workers.check_alive()
                time.sleep(0.05)
            raise

    @contextmanager
    def _drafter_split_forward(self, rows: list[DraftRow]) -> Iterator[None]:
        """Rank 0's drafter runs a forward split over the ranks inside this: the workers run it
        too (``DraftForward``)."""
        self.workers.broadcast(DraftForward(rows))
        with self._naming_lost_rank():
            yield

    def _drafter_after_step(
        self, sampled: dict[str, int], spec_sampled: dict[str, list[int]], drafting_off: bool
    ) -> None:
        """Rank 0's drafter is about to run ``after_step`` on the step just completed: the worker
        ranks run it too, with rank 0's tokens (their own samples are dropped)."""
        self.workers.broadcast(DrafterAfterStep(sampled, spec_sampled, drafting_off))

    def drop_finished(self, request_ids: list[str]) -> None:
        super().drop_finished(request_ids)
        if request_ids:
            self.workers.broadcast(DropFinished(request_ids))

    def check_alive(self) -> None:
        """PCPWorkerError naming a worker rank whose process is gone (the node's watch polls it)."""
        self.workers.check_alive()

    def close(self) -> None:
        super().close()
        self.workers.close()
        destroy_pcp_group()
