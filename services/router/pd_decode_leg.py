"""The decode leg: one start on the decode node's Steps stream (services/router/step_mux.py) that
pulls the KV from prefill (or prefills the prompt itself, on the local path) and streams the rest.

``PDBackend.decode_leg`` (services/router/pd_backend.py) runs ``DecodeLegs.run`` when ``PDFlow``
(services/router/pd_flow.py) enters LOCAL, DECODE or DECODE_EARLY; the early leg is opened
together with the prefill leg (``open_early``, PREFILL_EARLY) and either read here or dropped
(``drop_early``). The leg's ``DecodeRequest`` comes from services/router/pd_messages.py. Its
ends: the request's finish; an error delta for the client (the leg's deadlines, a failed node);
``KVLoadFailedError`` for the flow to re-prefill; ``CapacityError`` / ``InvalidRequestError``
for a 503 / 400. On any end but the finish the legs are aborted (services/router/pd_aborts.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

import grpc
from prometheus_client import Histogram

from pdserve import tracing
from pdserve.engine.outputs import GenerationDelta
from pdserve.errors import CapacityError, InvalidRequestError
from pdserve.kvtransfer.load_policy import KV_LOAD_FAILED_KEY
from pdserve.rpc import convert
from services.router.backend import BackendRequest
from services.router.nodes import NodeHandle, RouterPolicy, record_leg_result
from services.router.pd_aborts import LegAborts
from services.router.pd_flow import KVLoadFailedError
from services.router.pd_messages import decode_request
from services.router.step_mux import StepLeg, StepMux

logger = logging.getLogger(__name__)


class DecodeLegs:
    """The router's decode legs over the nodes' Steps streams (``steps_mux``: a node's
    ``StepMux``), with ``first_delta_by_path`` (path -> the first-delta histogram) and
    ``count_leg_failure`` (the backend's leg-failure counter)."""

    def __init__(
        self,
        steps_mux: Callable[[NodeHandle], StepMux],
        aborts: LegAborts,
        first_delta_by_path: dict[str, Histogram],
        count_leg_failure: Callable[[str, str], None],
        leg_span: Callable[[str, BackendRequest, NodeHandle], Any],  # (name, request, node) -> span
    ) -> None:
        self.steps_mux = steps_mux
        self.aborts = aborts
        self.first_delta_by_path = first_delta_by_path
        self.count_leg_failure = count_leg_failure
        self.leg_span = leg_span
        self._early_spans: dict[str, Any] = {}  # early decode legs' spans, until read

    def open_early(
        self,
        policy: RouterPolicy,
        d_node: NodeHandle,
        req: BackendRequest,
        transfer_id: str,
        p_node: NodeHandle,
    ) -> tuple[StepLeg, str]:
        """The decode leg opened with the prefill leg (PDFlow's PREFILL_EARLY): decode allocates
        and asks prefill for the KV at once; the pull brings the first token."""
        d_node.in_flight += 1
        leg = self.leg_span("router.decode_leg", req, d_node)
        msg = decode_request(
            req, policy, transfer_id, p_node, [], early=True, traceparent=tracing.traceparent(leg)
        )
        # Its own id on the node: a leg opened after it for the same request (another prefill
        # node, the local fallback, a re-prefill) never meets its abort or its bookkeeping.
        msg.request_id = f"{req.request_id}/early"
        self._early_spans[msg.request_id] = leg
        return self.steps_mux(d_node).open(msg, policy.request_timeout_s), msg.request_id

    async def drop_early(self, d_node: NodeHandle, early: tuple[StepLeg, str]) -> None:
        """An early decode leg nobody will read (its prefill failed, or the first token ended the
        request, or the client left): stop it and abort it on the node, which frees its blocks
        once its pull ends."""
        call, d_rid = early
        d_node.in_flight -= 1
        call.cancel()
        span = self._early_spans.pop(d_rid, None)
        if span is not None:
            span.end()
        await self.aborts.abort_both(d_node, d_rid, None, None)

    async def run(
        self,
        policy: RouterPolicy,
        d_node: NodeHandle,
        req: BackendRequest,
        transfer_id: str | None,
        p_node: NodeHandle | None,
        first_tokens: list[int],
        early: tuple[StepLeg, str] | None = None,
    ) -> AsyncGenerator[GenerationDelta, None]:
        """One decode leg on ``d_node``'s Steps stream: its deltas, the leg deadlines, and on any
        end other than the request's finish both legs aborted (the client left) or prefill's hold
        released (decode failed)."""
        call: StepLeg
        if early is not None:  # opened with the prefill leg (in_flight counted then), its own id
            call, d_rid = early
            leg = self._early_spans.pop(d_rid, None) or self.leg_span("router.decode_leg", req, d_node)
        else:
            d_node.in_flight += 1
            d_rid = req.request_id
            leg = self.leg_span("router.decode_leg", req, d_node)
            msg = decode_request(
                req, policy, transfer_id, p_node, first_tokens, traceparent=tracing.traceparent(leg)
            )
            call = self.steps_mux(d_node).open(msg, policy.request_timeout_s)
        # From here (the prefill leg's answer, on the P/D path) to decode's first delta.
        first_delta = self.first_delta_by_path["disaggregated" if transfer_id is not None else "local"]
        t_open = time.monotonic()
        finished = errored = streamed = False
        deadline = policy.decode_first_token_timeout_s
        try:
            while True:
                try:
                    m = await call.read(deadline)  # one timer for both deadlines, none if queued
                except TimeoutError:
                    # A frozen (SIGSTOPped) or wedged decode node: noticed within the leg's
                    # deadline, not by the request timeout; both legs are cancelled below.
                    call.cancel()
                    self.count_leg_failure("decode", "LEG_DEADLINE")
                    d_node.breaker.record_failure()
                    finished = errored = True
                    # In the background: a frozen node would hold the client for the abort's timeout.
                    self.aborts.in_background(self.aborts.abort_both(d_node, d_rid, p_node, transfer_id))
                    yield _error_delta(
                        req,
                        f"decode node {d_node.name} sent nothing for {deadline:g} s; the request was cancelled",
                    )
                    return
                deadline = policy.inter_token_timeout_s
                is_first, streamed = not streamed, True
                d = convert.delta_from_pb(m)
                d.request_id = req.request_id
                finished = d.finish_reason is not None
                errored = d.finish_reason == "error"
                if is_first and not errored:
                    first_delta.observe(time.monotonic() - t_open)
                if finished and not errored:
                    d_node.breaker.record_success()
                yield d
                if finished:
                    return
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.ABORTED and _kv_load_failed(e):
                finished = errored = True  # nothing streamed from decode yet; no node fault
                self.count_leg_failure("decode", "KV_LOAD_FAILED")
                raise KVLoadFailedError(e.details() or "KV load failed") from e
            self.count_leg_failure("decode", e.code().name)
            logger.warning(
                "decode leg of %s on %s failed: %s %s",
                req.request_id,
                d_node.name,
                e.code().name,
                e.details(),
            )
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT and transfer_id is None:
                raise InvalidRequestError(e.details() or "invalid request") from e
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and not streamed:
                # The node's queue limit / queue wait (max_queue_*): nothing was generated and
                # the node holds nothing; a 503 for the client. errored: prefill's hold (P/D)
                # is released in the finally below.
                finished = errored = True
                raise CapacityError(e.details() or f"decode node {d_node.name} is full; retry later") from e
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                d_node.healthy = False
                if transfer_id is None and not finished and not streamed:
                    # Refused before anything reached the client (a draining or gone node): a
                    # retryable 503, not a failed generation (GenerateBackend's contract).
                    finished = True  # nothing was admitted, nothing to abort
                    raise CapacityError(
                        f"decode node {d_node.name} unavailable: {e.details()}; retry later"
                    ) from e
            record_leg_result(d_node, e.code())
            finished = errored = True
            yield _error_delta(req, f"decode failed: {e.code().name}: {e.details()}")
        finally:
            d_node.in_flight -= 1
            leg.end()
            if not finished:
                # Client gone (cancellation / aclose): cancel both legs at once.
                call.cancel()
                await asyncio.shield(self.aborts.abort_both(d_node, d_rid, p_node, transfer_id))
            elif errored and p_node is not None and transfer_id is not None:
                # Decode failed (maybe before its pull): make sure prefill lets go of the KV now.
                await asyncio.shield(self.aborts.abort_prefill(p_node, transfer_id))


def _kv_load_failed(e: grpc.aio.AioRpcError) -> bool:
    md = e.trailing_metadata() or ()
    return any(k == KV_LOAD_FAILED_KEY for k, _ in md)


def _error_delta(req: BackendRequest, message: str) -> GenerationDelta:
    return GenerationDelta(
        request_id=req.request_id,
        token_ids=[],
        text="",
        finish_reason="error",
        error=message,
        num_prompt_tokens=req.num_prompt_tokens,
    )
