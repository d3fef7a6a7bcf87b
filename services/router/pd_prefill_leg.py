"""The prefill leg: P.Prefill returns a request's first token while P holds the KV under a lease.

``PDBackend.prefill_leg`` (services/router/pd_backend.py) runs ``PrefillLegs.run`` when
``PDFlow`` (services/router/pd_flow.py) enters PREFILL, PREFILL_EARLY or REPREFILL. Its answer
goes to the decode leg (services/router/pd_decode_leg.py), which pulls that KV: the epoch P
answered with (``NodeHandle.epoch_by_transfer``) and the adapter identity the KV was computed
under (``BackendRequest.lora_ident``). A failed call raises its ``AioRpcError`` for the flow to
judge; a cancelled or timed-out one aborts P's hold first (services/router/pd_aborts.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc
from prometheus_client import Histogram

from pdserve import tracing
from pdserve.engine.outputs import GenerationDelta
from pdserve.rpc import convert
from pdserve.rpc import node_pb2_grpc as pb_grpc
from services.router.backend import BackendRequest
from services.router.nodes import NodeHandle, RouterPolicy
from services.router.pd_aborts import LegAborts
from services.router.pd_messages import prefill_request

logger = logging.getLogger(__name__)


class PrefillLegs:
    """The router's prefill legs: the Prefill call with the shared token (``metadata``) and the
    leg's trace context, ``leg_seconds`` for the successful ones, and the adapter identities
    prefill answers with learnt into ``lora_idents`` (the backend's)."""

    def __init__(
        self,
        metadata: tuple[tuple[str, str], ...] | None,
        aborts: LegAborts,
        leg_seconds: Histogram,
        lora_idents: dict[str, str],
        leg_span: Callable[[str, BackendRequest, NodeHandle], Any],  # (name, request, node) -> span
    ) -> None:
        self._md = metadata
        self.aborts = aborts
        self.leg_seconds = leg_seconds
        self.lora_idents = lora_idents
        self.leg_span = leg_span

    async def run(
        self, policy: RouterPolicy, p: NodeHandle, req: BackendRequest, transfer_id: str, d_pp: int, d_tp: int
    ) -> GenerationDelta:
        stub = pb_grpc.PrefillServiceStub(p.channel)
        p.in_flight += 1
        t0 = time.monotonic()
        leg = self.leg_span("router.prefill_leg", req, p)
        tp = tracing.traceparent(leg)
        md = (*(self._md or ()), ("traceparent", tp)) if tp else self._md
        try:
            call = stub.Prefill(
                prefill_request(req, transfer_id, p, d_pp, d_tp),
                timeout=policy.prefill_timeout_s,
                metadata=md,
            )
            try:
                resp = await call
            except asyncio.CancelledError:
                call.cancel()
                await self.aborts.abort_prefill(p, transfer_id)
                raise
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    # Past prefill_timeout_s: P may still finish and hold the KV for nobody (it
                    # frees it when it sees the cancelled call; the Abort makes sure, at once).
                    logger.warning(
                        "prefill leg of %s on %s: no first token within prefill_timeout_s (%g s)",
                        req.request_id,
                        p.name,
                        policy.prefill_timeout_s,
                    )
                    self.aborts.in_background(self.aborts.abort_prefill(p, transfer_id))
                raise
        finally:
            p.in_flight -= 1
            leg.end()
        self.leg_seconds.observe(time.monotonic() - t0)
        d = convert.delta_from_pb(resp.first)
        d.request_id = req.request_id
        if resp.epoch:
            p.epoch_by_transfer[transfer_id] = resp.epoch  # read (and dropped) by the decode leg
        req.lora_ident = resp.lora_ident  # the adapter content the KV was computed under
        if req.lora_name and resp.lora_ident:
            self.lora_idents[req.lora_name] = resp.lora_ident
        return d
