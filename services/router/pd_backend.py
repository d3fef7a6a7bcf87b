"""The router's real backend: the request lifecycle over prefill and decode nodes (docs/design.md §2).

    ACCEPTED -> DISPATCHED(P, D, transfer_id) -> STREAMING -> DONE | FAILED | CANCELLED

1. pick a path: prompts shorter than ``local_prefill_max_tokens`` (or whose leading blocks the
   decode node has recently seen) are prefilled on the decode node; the rest go to a prefill node;
2. P.Prefill(transfer_id) returns the first token while P holds the KV under a lease;
3. the decode leg (a start on the node's Steps stream, services/router/step_mux.py) pulls the KV
   from P and streams the rest;
4. on client disconnect, error or timeout the other leg is cancelled at once (P.Abort / D.Abort).

The order of the legs, retries, fallbacks and re-prefills is ``PDFlow``'s state machine
(services/router/pd_flow.py); this module makes the legs' calls and keeps their metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Coroutine
from typing import Any

import grpc
from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Histogram

from pdserve import tracing
from pdserve.engine.block_pool import hash_prompt_blocks
from pdserve.engine.outputs import GenerationDelta
from pdserve.errors import CapacityError, InvalidRequestError
from pdserve.kvtransfer.load_policy import KV_LOAD_FAILED_KEY
from pdserve.kvtransfer.topology import need_send
from pdserve.lora.ident import lora_block_salt
from pdserve.rpc import convert
from pdserve.rpc import node_pb2 as pb
from pdserve.rpc import node_pb2_grpc as pb_grpc
from services.router.backend import BackendRequest
from services.router.cache_aware import RouteKey
from services.router.dashboard import RecentErrors
from services.router.nodes import NodeHandle, NodePool, RouterPolicy, record_leg_result
from services.router.pd_flow import KVLoadFailedError, PDFlow
from services.router.route_info import note_route, route_attributes
from services.router.step_mux import StepLeg

logger = logging.getLogger(__name__)
AFFINITY_BLOCKS = 4  # leading blocks that decide prefix affinity
# Leg timings, 1 ms .. 60 s (a prefill leg is bounded by prefill_timeout_s, 30 s by default).
LEG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60)


class PDBackend(NodePool):
    """Implements ``GenerateBackend`` over gRPC (the nodes: ``NodePool``). Create inside the
    serving event loop."""

    def __init__(
        self,
        prefill: list[tuple[str, str]],
        decode: list[tuple[str, str]],
        policy: RouterPolicy | None = None,
        shared_token: str | None = None,
        registry: CollectorRegistry | None = None,
        discovered: bool = False,  # node lists filled later by services.router.discovery
    ) -> None:
        if not decode and not discovered:
            raise ValueError("the router needs at least one decode-capable node")
        reg = registry if registry is not None else CollectorRegistry()
        super().__init__(prefill, decode, policy or RouterPolicy(), shared_token, reg)
        self.path_total = Counter(
            "pdserve:router_requests_by_path",
            "Sequences by path: disaggregated (P then D) or local (prefill on the decode node).",
            ["path"],
            registry=reg,
        )
        self.leg_failures = Counter(
            "pdserve:router_leg_failures",
            "Failed legs, by node role and gRPC status.",
            ["role", "code"],
            registry=reg,
        )
        self.prefill_leg_seconds = Histogram(
            "pdserve:router_prefill_leg_seconds",
            "Successful prefill legs: the Prefill call to its answer (prefill's queue, the prompt, "
            "the first token with the KV held).",
            buckets=LEG_BUCKETS,
            registry=reg,
        )
        self.decode_first_delta_seconds = Histogram(
            "pdserve:router_decode_first_delta_seconds",
            "Decode legs: from the start of the leg's reading (on the disaggregated path: the "
            "prefill leg's answer) to its first delta, by path (disaggregated: what is left of "
            "decode's KV pull and its first step; local: the prompt prefilled on the decode node).",
            ["path"],
            buckets=LEG_BUCKETS,
            registry=reg,
        )
        self.recent_errors = RecentErrors()  # for /dashboard
        self._decode_leg_spans: dict[str, Any] = {}  # early decode legs' spans, until read
        self._first_delta_by_path = {
            "disaggregated": self.decode_first_delta_seconds.labels("disaggregated"),
            "local": self.decode_first_delta_seconds.labels("local"),
        }

    def prompt_hashes(self, req: BackendRequest, block_size: int) -> list[bytes]:
        """The prompt's block hashes as a node's prefix cache makes them (an adapter's salted by
        its content hash). Empty for embeddings (no token ids), images (placeholder ids are the
        same for every image) or an adapter whose identity is not known yet."""
        salt = lora_block_salt(self.lora_idents, req.lora_name)
        if req.prompt_embeds is not None or req.mm_items or salt is None:
            return []
        return hash_prompt_blocks(req.prompt_token_ids, block_size, salt)

    def prefill_locally(self, req: BackendRequest, hashes: list[bytes], d_node: NodeHandle) -> bool:
        """Conditional disaggregation: prefill on the decode node when the prompt is short, when
        the decode node recently saw (nearly) all of its blocks, or when there is no prefill node.
        Requests with images always go to a prefill node (the EC consumer) when there is one:
        decode never receives images or embeddings."""
        if req.mm_items:
            return not self.prefill
        if not self.prefill or req.num_prompt_tokens < self.policy.local_prefill_max_tokens:
            return True
        if self.policy.policy == "cache_aware" and self.prefix_index is not None:
            # What the decode node holds (KV events): a follow-up whose history it kept computes
            # only its new tokens there, with no prefill leg and no transfer.
            if hashes and d_node.block_size != self.decode[0].block_size:  # hashed at decode[0]'s size
                hashes = self.prompt_hashes(req, d_node.block_size)
            held = self.prefix_index.overlap(d_node.name, hashes)
            if req.num_prompt_tokens - held * d_node.block_size < self.policy.local_prefill_max_tokens:
                return True
            return bool(hashes) and held >= self.policy.local_prefill_min_hit_frac * len(hashes)
        seen = sum(1 for h in hashes if h in d_node.seen_prefixes)
        return bool(hashes) and seen >= self.policy.local_prefill_min_hit_frac * len(hashes)

    # -- the lifecycle (services/router/pd_flow.py) ----------------------------------------------
    async def generate(self, req: BackendRequest) -> AsyncGenerator[GenerationDelta, None]:
        self.start()
        t_route = time.monotonic()
        bs = self.decode[0].block_size
        # No hashes (embeddings, images, an adapter not known yet): no affinity, no "seen on
        # decode" shortcut.
        hashes = self.prompt_hashes(req, bs)
        key = hashes[min(len(hashes), AFFINITY_BLOCKS) - 1] if hashes else None
        if key is not None and self.policy.policy == "cache_aware":
            salt = lora_block_salt(self.lora_idents, req.lora_name) or b""
            key = RouteKey(key, hashes, req.prompt_token_ids, bs, salt)
        d_node = self.pick(self.decode, key)
        if req.mm_needs_ec and not self.prefill:
            raise CapacityError(
                "image_url requests need a prefill node (it fetches or computes the embeddings); none is up"
            )

        def remember() -> None:
            for h in hashes:
                d_node.remember_prefix(h)

        local = self.prefill_locally(req, hashes, d_node)
        note_route("path", "local" if local else "disaggregated")
        # The root span from here: a refusal above (no node) leaves no trace.
        t_arrival = min(req.arrival_s, t_route) if req.arrival_s is not None else t_route
        root = req.trace_span
        if root is None:  # else begun at arrival (the encoder's spans are its children)
            root = req.trace_span = tracing.start_span("router.request", t_arrival)
        root.set_attributes(
            {"pdserve.request_id": req.request_id, "pdserve.prompt_tokens": req.num_prompt_tokens}
        )
        tracing.record("router.admission", root, t_arrival, t_route)
        tracing.record("router.route", root, t_route, time.monotonic(), **route_attributes())
        flow = PDFlow(self, req, d_node, key, local=local, on_done=remember)
        try:
            async for d in flow.run():
                yield d
        finally:
            root.set_attributes(route_attributes())  # with the prefill node PDFlow chose
            root.end()

    # -- pd_flow.LegClient (pick: NodePool's) -------------------------------------------------
    def count_path(self, path: str) -> None:
        self.path_total.labels(path).inc()

    def count_leg_failure(self, role: str, code: str) -> None:
        self.leg_failures.labels(role, code).inc()
        self.recent_errors.add(role, code)

    async def prefill_leg(
        self, p: NodeHandle, req: BackendRequest, transfer_id: str, d_pp: int = 1, d_tp: int = 1
    ) -> GenerationDelta:
        stub = pb_grpc.PrefillServiceStub(p.channel)
        p.in_flight += 1
        t0 = time.monotonic()
        leg = self._leg_span("router.prefill_leg", req, p)
        tp = tracing.traceparent(leg)
        md = (*(self._md or ()), ("traceparent", tp)) if tp else self._md
        try:
            call = stub.Prefill(
                pb.PrefillRequest(
                    transfer_id=transfer_id,
                    prompt_token_ids=req.prompt_token_ids,
                    sampling=convert.sampling_to_pb(req.sampling_params),
                    # pulls each prefill stage / TP rank waits for
                    need_send=need_send(p.tp_size, p.pp_size, d_tp, d_pp),
                    prompt_embeds=_embeds_pb(req),
                    mm_items=_mm_items_pb(req, with_tensors=True),
                    lora_name=req.lora_name,
                ),
                timeout=self.policy.prefill_timeout_s,
                metadata=md,
            )
            try:
                resp = await call
            except asyncio.CancelledError:
                call.cancel()
                await self.abort_prefill(p, transfer_id)
                raise
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    # Past prefill_timeout_s: P may still finish and hold the KV for nobody (it
                    # frees it when it sees the cancelled call; the Abort makes sure, at once).
                    logger.warning(
                        "prefill leg of %s on %s: no first token within prefill_timeout_s (%g s)",
                        req.request_id,
                        p.name,
                        self.policy.prefill_timeout_s,
                    )
                    self._background(self.abort_prefill(p, transfer_id))
                raise
        finally:
            p.in_flight -= 1
            leg.end()
        self.prefill_leg_seconds.observe(time.monotonic() - t0)
        d = convert.delta_from_pb(resp.first)
        d.request_id = req.request_id
        if resp.epoch:
            p.epoch_by_transfer[transfer_id] = resp.epoch  # read (and dropped) by the decode leg
        req.lora_ident = resp.lora_ident  # the adapter content the KV was computed under
        if req.lora_name and resp.lora_ident:
            self.lora_idents[req.lora_name] = resp.lora_ident
        return d

    def _decode_msg(
        self,
        req: BackendRequest,
        transfer_id: str | None,
        p_node: NodeHandle | None,
        first_tokens: list[int],
        early: bool = False,
        traceparent: str = "",
    ) -> pb.DecodeRequest:
        params = req.sampling_params
        if transfer_id is not None and params.prompt_logprobs is not None:
            # Prefill returned them with the first token; decode does not compute the prompt.
            params = dataclasses.replace(params, prompt_logprobs=None)
        return pb.DecodeRequest(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling=convert.sampling_to_pb(params),
            output_token_ids=first_tokens,
            remote_prefill=transfer_id is not None,
            transfer_id=transfer_id or "",
            prefill_address=p_node.address if p_node else "",
            prefill_epoch=p_node.epoch_by_transfer.pop(transfer_id, "") if p_node and transfer_id else "",
            # Decode needs the embeddings only if it prefills (local path, or recompute after a
            # failed pull); sent always so the recompute policy stays correct.
            prompt_embeds=_embeds_pb(req),
            # Keys only when prefill computed the prompt (the KV holds the images); tensors only
            # when decode prefills it itself (precomputed image_embeds on a cluster without P).
            mm_items=_mm_items_pb(req, with_tensors=transfer_id is None),
            # Tokens nobody reads before the end travel in a few messages, not one per step;
            # streamed ones too when router.stream_flush_ms asks for it.
            flush_interval_ms=self.policy.stream_flush_ms if req.streamed else self.policy.nonstream_flush_ms,
            first_token_from_prefill=early,
            lora_name=req.lora_name,
            # KV pulled from prefill: decode must hold the content prefill used (pd_flow opens no
            # early leg for an adapter request, so prefill has answered by now)
            lora_ident=req.lora_ident if transfer_id is not None else "",
            traceparent=traceparent,
        )

    def open_early_leg(
        self, d_node: NodeHandle, req: BackendRequest, transfer_id: str, p_node: NodeHandle
    ) -> tuple[StepLeg, str]:
        """The decode leg opened with the prefill leg (PDFlow's PREFILL_EARLY): decode allocates
        and asks prefill for the KV at once; the pull brings the first token."""
        d_node.in_flight += 1
        leg = self._leg_span("router.decode_leg", req, d_node)
        msg = self._decode_msg(req, transfer_id, p_node, [], early=True, traceparent=tracing.traceparent(leg))
        # Its own id on the node: a leg opened after it for the same request (another prefill
        # node, the local fallback, a re-prefill) never meets its abort or its bookkeeping.
        msg.request_id = f"{req.request_id}/early"
        self._decode_leg_spans[msg.request_id] = leg
        return self.steps_mux(d_node).open(msg, self.policy.request_timeout_s), msg.request_id

    async def drop_early_leg(self, d_node: NodeHandle, early: tuple[StepLeg, str]) -> None:
        """An early decode leg nobody will read (its prefill failed, or the first token ended the
        request, or the client left): stop it and abort it on the node, which frees its blocks
        once its pull ends."""
        call, d_rid = early
        d_node.in_flight -= 1
        call.cancel()
        span = self._decode_leg_spans.pop(d_rid, None)
        if span is not None:
            span.end()
        await self._abort_both(d_node, d_rid, None, None)

    async def decode_leg(
        self,
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
            leg = self._decode_leg_spans.pop(d_rid, None) or self._leg_span("router.decode_leg", req, d_node)
        else:
            d_node.in_flight += 1
            d_rid = req.request_id
            leg = self._leg_span("router.decode_leg", req, d_node)
            msg = self._decode_msg(
                req, transfer_id, p_node, first_tokens, traceparent=tracing.traceparent(leg)
            )
            call = self.steps_mux(d_node).open(msg, self.policy.request_timeout_s)
        # From here (the prefill leg's answer, on the P/D path) to decode's first delta.
        first_delta = self._first_delta_by_path["disaggregated" if transfer_id is not None else "local"]
        t_open = time.monotonic()
        finished = errored = streamed = False
        deadline = self.policy.decode_first_token_timeout_s
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
                    self._background(self._abort_both(d_node, d_rid, p_node, transfer_id))
                    yield _error_delta(
                        req,
                        f"decode node {d_node.name} sent nothing for {deadline:g} s; the request was cancelled",
                    )
                    return
                deadline = self.policy.inter_token_timeout_s
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
                await asyncio.shield(self._abort_both(d_node, d_rid, p_node, transfer_id))
            elif errored and p_node is not None and transfer_id is not None:
                # Decode failed (maybe before its pull): make sure prefill lets go of the KV now.
                await asyncio.shield(self.abort_prefill(p_node, transfer_id))

    def _leg_span(self, name: str, req: BackendRequest, n: NodeHandle) -> Any:
        """A leg's span under the sequence's root (a no-op span when tracing is off)."""
        parent = trace.set_span_in_context(req.trace_span) if req.trace_span is not None else None
        return tracing.tracer.start_span(name, context=parent, attributes={"pdserve.node": n.name})

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def abort_prefill(self, p: NodeHandle, transfer_id: str) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await pb_grpc.PrefillServiceStub(p.channel).Abort(
                pb.AbortRequest(transfer_ids=[transfer_id]), timeout=5.0, metadata=self._md
            )

    async def _abort_both(
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


def _kv_load_failed(e: grpc.aio.AioRpcError) -> bool:
    md = e.trailing_metadata() or ()
    return any(k == KV_LOAD_FAILED_KEY for k, _ in md)


def _embeds_pb(req: BackendRequest) -> pb.Tensor | None:
    return convert.tensor_to_pb(req.prompt_embeds) if req.prompt_embeds is not None else None


def _mm_items_pb(req: BackendRequest, *, with_tensors: bool) -> list[pb.MmItem]:
    return [
        pb.MmItem(
            offset=it.offset,
            length=it.length,
            key=it.key,
            embeds=convert.tensor_to_pb(it.embeds) if with_tensors and it.embeds is not None else None,
            encoder_address=it.encoder_address,
            image=it.image if with_tensors and it.image is not None else b"",  # never to decode
        )
        for it in req.mm_items
    ]


def _error_delta(req: BackendRequest, message: str) -> GenerationDelta:
    return GenerationDelta(
        request_id=req.request_id,
        token_ids=[],
        text="",
        finish_reason="error",
        error=message,
        num_prompt_tokens=req.num_prompt_tokens,
    )
