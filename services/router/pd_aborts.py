"""Aborting the legs of a request on their nodes: what frees prefill's held KV and decode's blocks
when a leg ends other than by the request's finish.

``LegAborts`` is made by ``PDBackend`` (services/router/pd_backend.py) and used by both legs: the
prefill leg (services/router/pd_prefill_leg.py) aborts P when its call is cancelled or past its
deadline; the decode leg (services/router/pd_decode_leg.py) aborts both legs when the client left
or its node stopped sending, and releases prefill's hold when decode failed. An abort against a
frozen node would hold the client for its timeout: those run in the background, and
``NodePool.close`` waits for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

import grpc

from pdserve.rpc import node_pb2 as pb
from pdserve.rpc import node_pb2_grpc as pb_grpc
from services.router.nodes import NodeHandle

logger = logging.getLogger(__name__)


class LegAborts:
    """P.Abort / D.Abort calls with the cluster's shared token (``metadata``); background ones
    go into ``tasks`` (the pool's background work)."""

    def __init__(self, metadata: tuple[tuple[str, str], ...] | None, tasks: set[asyncio.Task[None]]) -> None:
        self._md = metadata
        self._tasks = tasks

    def in_background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def abort_prefill(self, p: NodeHandle, transfer_id: str) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await pb_grpc.PrefillServiceStub(p.channel).Abort(
                pb.AbortRequest(transfer_ids=[transfer_id]), timeout=5.0, metadata=self._md
            )

    async def abort_both(
        self, d: NodeHandle, request_id: str, p: NodeHandle | None, transfer_id: str | None
    ) -> None:
        tasks = [
            pb_grpc.DecodeServiceStub(d.channel).Abort(
                pb.AbortRequest(request_ids=[request_id]), timeout=5.0, metadata=self._md
            )
        ]
        if p is not None and transfer_id is not None:
            tasks.append(
                pb_grpc.PrefillServiceStub(p.channel).Abort(
                    pb.AbortRequest(transfer_ids=[transfer_id]), timeout=5.0, metadata=self._md
                )
            )
        for r in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(r, BaseException):
                logger.warning("abort after disconnect failed: %s", r)
