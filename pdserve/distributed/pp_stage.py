"""Pipeline parallelism beneath the engine: what the node sees of it, and the stage links.

One scheduler per node, one model slice per stage. The engine core (scheduler + KV cache
manager) stays in the node's process, which also runs stage 0; stages 1..N-1 are worker
processes (``pdserve.distributed.workers``), each with its own ``ModelRunner`` over a contiguous
layer slice (``topology.split_layers``) and its own KV cache tensor with the same number of
blocks (one block table per node: block ids mean the same on every stage).

    engine core + stage 0                stage 1 (process)            stage N-1 (process)
    sched = scheduler.schedule()
    --pipe: ExecuteStep(sched)---------> recv sched          ...      recv sched
    stage 0 forward -- dist.send ------> dist.recv, forward -- ... -> dist.recv, forward, sample
    <---------------------------------------------------------- pipe: StepResult

Hidden states and the residual pass with ``torch.distributed`` point-to-point send/recv (gloo on
CPU, NCCL on CUDA), shape first so a stage need not re-derive token counts. A stage that dies or
fails raises ``PipelineStageError`` at the next call: the engine fails its requests and the node
turns NOT_SERVING (``services.stage_watchdog``).

KV transfer (prefill / decode nodes): ``start_kv_endpoints`` makes every stage process open its
own transfer engine (Mooncake) and register its own KV cache there; it answers with its session
address and regions (``StageEndpoint``). Decode stages then only receive (peers write into their
registered memory). Prefill stages write on command: a second pipe per stage (the transfer pipe,
separate from the command pipe the engine thread owns) carries a ``WriteKV`` to a thread in the
stage process. ``StageWriteBackend`` is that pipe seen as a ``TransferBackend``, so one
``KVProducer`` per stage works unchanged.

TP ranks take the same path: ``KVWorkers`` is the part of both runners the node uses for KV
transfer (every worker process, a stage or a TP rank, registers its own KV and writes on
command), so a prefill node has one ``KVProducer`` per (stage, TP rank) and a decode node one
endpoint per (stage, TP rank); TP and PP on one node together stay refused (``ParallelConfig``).

``PipelineRunner`` is the interface the node uses; the engine implements it
(``pdserve.engine.pipeline``, with the stage links' send/recv in ``pdserve.engine.workers``),
which keeps this package free of engine and model imports.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from pdserve.distributed.workers import PipelineStageError
from pdserve.kvtransfer.backend import TransferBackend
from pdserve.kvtransfer.head_slices import HeadGather
from pdserve.kvtransfer.regions import Descriptors, Region

__all__ = [
    "KVWorkers",
    "PipelineRunner",
    "PipelineStageError",
    "StageEndpoint",
    "StageWriteBackend",
]

STAGE_WRITE_TIMEOUT_S = 120.0  # one write a stage process runs for the node's PushKV


@dataclass(frozen=True)
class StageEndpoint:
    """One stage's (one TP rank's) KV transfer endpoint: its layers, its KV heads, its engine's
    session, its KV regions. ``worker``: the node's worker process that holds it (0: the node's
    own process; a pipeline stage's or TP rank's index otherwise)."""

    pp_rank: int
    pp_size: int
    layer_start: int
    layer_end: int
    session: str
    regions: tuple[Region, ...]
    tp_rank: int = 0
    tp_size: int = 1
    worker: int = 0


class KVWorkers(abc.ABC):
    """The worker processes of an engine (pipeline stages or TP ranks 1..N-1) as KV endpoints."""

    @abc.abstractmethod
    def start_kv_endpoints(self, kv_transport: str, kv_host: str) -> list[StageEndpoint]:
        """Workers 1..N-1 open their own transfer engine and register their KV cache (after
        ``init_kv_cache``, before the engine thread starts); returns their endpoints."""

    @abc.abstractmethod
    def stage_write(
        self,
        rank: int,
        peer_session: str,
        descs: Descriptors,
        transfer_id: str,
        gather: HeadGather | None = None,
    ) -> None:
        """Worker ``rank`` (>= 1) writes ``descs`` (its own memory -> the peer's) with its engine;
        with ``gather``, from those heads packed first (``descs`` relative to the pack).
        Raises TransferError if the write failed, the group's WorkerError if the worker is gone."""

    @abc.abstractmethod
    def check_alive(self) -> None:
        """Raise the group's WorkerError naming a worker process that is gone."""

    @abc.abstractmethod
    def stage_pids(self) -> list[int]:
        """The process ids of workers 1..N-1."""


class PipelineRunner(KVWorkers):
    """The engine's runner when ``pipeline_parallel_size`` > 1, as the node uses it."""

    ranges: list[tuple[int, int]]  # every stage's [start, end) layers

    @property
    def num_stages(self) -> int:
        return len(self.ranges)


class StageWriteBackend(TransferBackend):
    """A worker's (stage's or TP rank's) transfer engine as seen from the node's process: writes
    go through the transfer pipe (``KVWorkers.stage_write``); memory is registered in the worker."""

    def __init__(self, runner: KVWorkers, endpoint: StageEndpoint) -> None:
        self._runner = runner
        self._endpoint = endpoint

    @property
    def session_id(self) -> str:
        return self._endpoint.session

    def register(self, addr: int, length: int) -> None:
        raise NotImplementedError("a stage's KV is registered in its own process")

    def unregister(self, addr: int) -> None:
        raise NotImplementedError("a stage's KV is registered in its own process")

    def write(self, peer_session: str, descs: Descriptors, *, transfer_id: str) -> None:
        self._runner.stage_write(self._endpoint.worker, peer_session, descs, transfer_id)

    def write_gathered(
        self, peer_session: str, gather: HeadGather, descs: Descriptors, *, transfer_id: str
    ) -> None:
        self._runner.stage_write(self._endpoint.worker, peer_session, descs, transfer_id, gather)

    def close(self) -> None:
        pass  # the stage process closes its engine when it exits
