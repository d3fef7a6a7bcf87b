"""The router's real backend: the request lifecycle over prefill and decode nodes (docs/design.md §2).

    ACCEPTED -> DISPATCHED(P, D, transfer_id) -> STREAMING -> DONE | FAILED | CANCELLED

How a request moves through the modules:

1. ``PDBackend.generate`` (here) picks a path: prompts shorter than ``local_prefill_max_tokens``
   (or whose leading blocks the decode node has recently seen) are prefilled on the decode node;
   the rest go to a prefill node. ``PDFlow`` (services/router/pd_flow.py) then orders the legs,
   retries, fallbacks and re-prefills as a state machine, calling the legs through this class
   (its ``LegClient``);
2. the prefill leg (services/router/pd_prefill_leg.py): P.Prefill(transfer_id) returns the first
   token while P holds the KV under a lease;
3. the decode leg (services/router/pd_decode_leg.py: a start on the node's Steps stream,
   services/router/step_mux.py) pulls the KV from P and streams the rest;
4. on client disconnect, error or timeout the other leg is cancelled at once (P.Abort / D.Abort:
   services/router/pd_aborts.py).

The legs' messages are built in services/router/pd_messages.py. This class keeps the legs'
metrics and their spans under the request's root span.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Histogram

from pdserve import tracing
from pdserve.engine.block_pool import hash_prompt_blocks
from pdserve.engine.outputs import GenerationDelta
from pdserve.errors import CapacityError
from pdserve.lora.ident import lora_block_salt
from services.router.backend import BackendRequest
from services.router.cache_aware import RouteKey
from services.router.dashboard import RecentErrors
from services.router.nodes import NodeHandle, NodePool, RouterPolicy
from services.router.pd_aborts import LegAborts
from services.router.pd_decode_leg import DecodeLegs
from services.router.pd_flow import PDFlow
from services.router.pd_prefill_leg import PrefillLegs
from services.router.route_info import note_route, route_attributes
from services.router.step_mux import StepLeg

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
        first_delta_by_path = {
            "disaggregated": self.decode_first_delta_seconds.labels("disaggregated"),
            "local": self.decode_first_delta_seconds.labels("local"),
        }
        self.aborts = LegAborts(self._md, self._tasks)  # background ones: NodePool.close waits
        self.prefill_legs = PrefillLegs(
            self._md, self.aborts, self.prefill_leg_seconds, self.lora_idents, self._leg_span
        )
        self.decode_legs = DecodeLegs(
            self.steps_mux, self.aborts, first_delta_by_path, self.count_leg_failure, self._leg_span
        )

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
        """P.Prefill (services/router/pd_prefill_leg.py)."""
        return await self.prefill_legs.run(self.policy, p, req, transfer_id, d_pp, d_tp)

    def open_early_leg(
        self, d_node: NodeHandle, req: BackendRequest, transfer_id: str, p_node: NodeHandle
    ) -> tuple[StepLeg, str]:
        """The decode leg opened with the prefill leg (services/router/pd_decode_leg.py)."""
        return self.decode_legs.open_early(self.policy, d_node, req, transfer_id, p_node)

    async def drop_early_leg(self, d_node: NodeHandle, early: tuple[StepLeg, str]) -> None:
        """Stop an early decode leg nobody will read and abort it on the node."""
        await self.decode_legs.drop_early(d_node, early)

    def decode_leg(
        self,
        d_node: NodeHandle,
        req: BackendRequest,
        transfer_id: str | None,
        p_node: NodeHandle | None,
        first_tokens: list[int],
        early: tuple[StepLeg, str] | None = None,
    ) -> AsyncGenerator[GenerationDelta, None]:
        """The decode leg's deltas on ``d_node``'s Steps stream (services/router/pd_decode_leg.py)."""
        return self.decode_legs.run(self.policy, d_node, req, transfer_id, p_node, first_tokens, early)

    async def abort_prefill(self, p: NodeHandle, transfer_id: str) -> None:
        """P.Abort: prefill frees the KV held under ``transfer_id`` now."""
        await self.aborts.abort_prefill(p, transfer_id)

    def _leg_span(self, name: str, req: BackendRequest, n: NodeHandle) -> Any:
        """A leg's span under the sequence's root (a no-op span when tracing is off)."""
        parent = trace.set_span_in_context(req.trace_span) if req.trace_span is not None else None
        return tracing.tracer.start_span(name, context=parent, attributes={"pdserve.node": n.name})
