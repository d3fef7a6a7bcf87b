"""What pipeline stages and TP ranks share for KV transfer: register, write, pids.

``PipelineExecutor`` and ``TPModelRunner`` both keep a ``WorkerGroup`` with transfer pipes;
``RegisterKV`` makes each worker open its own transfer engine over its own KV tensor, and a
``WriteKV`` on a worker's transfer pipe runs one write there (``pdserve.engine.workers``). The
runners differ only in what an endpoint says about its worker (layers, or KV heads).
"""

from __future__ import annotations

import threading

from pdserve.distributed.pp_stage import STAGE_WRITE_TIMEOUT_S
from pdserve.distributed.workers import WorkerGroup
from pdserve.engine.workers import KVEndpoint, RegisterKV, WriteFailed, WriteKV
from pdserve.kvtransfer.backend import TransferError
from pdserve.kvtransfer.head_slices import HeadGather
from pdserve.kvtransfer.regions import Descriptors, Region, descriptor_list


class WorkerKV:
    """Mixin over ``self.workers`` (a ``WorkerGroup`` made with ``transfer_pipes=True``)."""

    workers: WorkerGroup
    _xlocks: list[threading.Lock]  # one per worker: its transfer pipe carries one write at a time

    def _init_worker_kv(self) -> None:
        self._xlocks = [threading.Lock() for _ in self.workers.ranks]

    def _register_workers(
        self, kv_transport: str, kv_host: str, timeout_s: float
    ) -> list[tuple[int, str, tuple[Region, ...]]]:
        """Every worker registers its KV with its own engine: (rank, session, regions) each."""
        out = []
        replies = self.workers.ask_all(RegisterKV(kv_transport, kv_host), timeout_s)
        for rank, reply in enumerate(replies, start=1):
            assert isinstance(reply, KVEndpoint), reply
            out.append((rank, reply.session, tuple(Region.from_dict(r) for r in reply.regions)))
        return out

    def stage_write(
        self,
        rank: int,
        peer_session: str,
        descs: Descriptors,
        transfer_id: str,
        gather: HeadGather | None = None,
    ) -> None:
        with self._xlocks[rank - 1]:
            msg = WriteKV(peer_session, descriptor_list(descs), transfer_id, gather)
            reply = self.workers.request(rank, msg, STAGE_WRITE_TIMEOUT_S, "finish a KV write")
        if isinstance(reply, WriteFailed):
            raise TransferError(
                peer_session, transfer_id, f"write from {self.workers.label} {rank}", None, reply.error
            )

    def stage_pids(self) -> list[int]:
        return self.workers.pids()
