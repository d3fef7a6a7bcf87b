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
turns NOT_SERVING (``services.node``).

KV transfer (prefill / decode nodes): ``start_kv_endpoints`` makes every stage process open its
own transfer engine (Mooncake) and register its own KV cache there; it answers with its session
address and regions (``StageEndpoint``). Decode stages then only receive (peers write into their
registered memory). Prefill stages write on command: a second pipe per stage (the transfer pipe,
separate from the command pipe the engine thread owns) carries a ``WriteKV`` to a thread in the
stage process. ``StageWriteBackend`` is that pipe seen as a ``TransferBackend``, so one
``KVProducer`` per stage works unchanged.

``PipelineRunner`` is the interface the node uses; the engine implements it
(``pdserve.engine.pipeline``, with the stage links' send/recv in ``pdserve.engine.workers``),
which keeps this package free of engine and model imports.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.distributed.workers import PipelineStageError
from pdserve.kvtransfer.backend import TransferBackend
from pdserve.kvtransfer.regions import Descriptor, Region

__all__ = [
    "PipelineRunner",
    "PipelineStageError",
    "StageEndpoint",
    "StageWriteBackend",
]

STAGE_WRITE_TIMEOUT_S = 120.0  # one write a stage process runs for the node's PushKV


@dataclass(frozen=True)
class StageEndpoint:
    """One stage's KV transfer endpoint: its layers, its engine's session, its KV regions."""

    pp_rank: int
    pp_size: int
    layer_start: int
    layer_end: int
    session: str
    regions: tuple[Region, ...]


class PipelineRunner(abc.ABC):
    """The engine's runner when ``pipeline_parallel_size`` > 1, as the node uses it."""

    ranges: list[tuple[int, int]]  # every stage's [start, end) layers

    @property
    def num_stages(self) -> int:
        return len(self.ranges)

    @abc.abstractmethod
    def start_kv_endpoints(self, kv_transport: str, kv_host: str) -> list[StageEndpoint]:
        """Stages 1..N-1 open their own transfer engine and register their KV cache (after
        ``init_kv_cache``, before the engine thread starts); returns their endpoints."""

    @abc.abstractmethod
    def stage_write(
        self, rank: int, peer_session: str, descs: Sequence[Descriptor], transfer_id: str
    ) -> None:
        """Stage ``rank`` (>= 1) writes ``descs`` (its own memory -> the peer's) with its engine.
        Raises TransferError if the write failed, PipelineStageError if the stage is gone."""

    @abc.abstractmethod
    def check_alive(self) -> None:
        """Raise PipelineStageError naming a stage process that is gone."""

    @abc.abstractmethod
    def stage_pids(self) -> list[int]:
        """The process ids of stages 1..N-1."""


class StageWriteBackend(TransferBackend):
    """Stage ``rank``'s transfer engine as seen from the node's process: writes go through the
    transfer pipe (``PipelineRunner.stage_write``); memory is registered in the stage process."""

    def __init__(self, runner: PipelineRunner, endpoint: StageEndpoint) -> None:
        self._runner = runner
        self._endpoint = endpoint

    @property
    def session_id(self) -> str:
        return self._endpoint.session

    def register(self, addr: int, length: int) -> None:
        raise NotImplementedError("a stage's KV is registered in its own process")

    def unregister(self, addr: int) -> None:
        raise NotImplementedError("a stage's KV is registered in its own process")

    def write(self, peer_session: str, descs: Sequence[Descriptor], *, transfer_id: str) -> None:
        self._runner.stage_write(self._endpoint.pp_rank, peer_session, descs, transfer_id)

    def close(self) -> None:
        pass  # the stage process closes its engine when it exits
