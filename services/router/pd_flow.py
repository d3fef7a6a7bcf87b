"""One request's P/D orchestration as a state machine (docs/design.md §2).

``PDFlow.run`` walks one sequence through these states; each transition is made in one place,
by the handler of the state it leaves::

    state          -> next state         when
    (start)        -> LOCAL              the path chosen is local (PDBackend.prefill_locally)
                   -> PREFILL_EARLY      router.pd_decode_leg with_prefill, no images
                   -> PREFILL            otherwise
    PREFILL(_EARLY)-> DECODE(_EARLY)     the first token came back (the client gets it)
                   -> DONE               that token finished the request (prefill's KV freed)
                   -> PREFILL            the leg failed, a prefill node is left (serial now)
                   -> LOCAL              the leg failed, none is left (local_fallback)
                   -> (raises)           INVALID_ARGUMENT, RESOURCE_EXHAUSTED, image failures
    DECODE(_EARLY) -> DONE               the decode leg ended (finished, or an error delta)
                   -> REPREFILL          decode's KV pull failed (KV_LOAD_FAILED)
    REPREFILL      -> DECODE             another prefill node holds the KV again, or decode
                                         recomputes it (reprefill / reprefill_local)
    LOCAL          -> DONE               the decode leg ended

- LOCAL: the decode node prefills the prompt itself (a short prompt, one whose blocks the decode
  node recently saw, no prefill node, or every prefill node failed).
- PREFILL / PREFILL_EARLY: a prefill leg on a node not tried yet returns the first token with the
  KV held. PREFILL_EARLY (``router.pd_decode_leg: with_prefill``, requests without images, the
  first prefill node only) opens the decode leg together with it: decode allocates and asks
  prefill for the KV at once, and the pull brings the first token. The early leg lives only in
  PREFILL_EARLY and DECODE_EARLY; leaving them any other way drops it (stopped, aborted on the
  node).
- DECODE / DECODE_EARLY: the decode leg streams the rest. A failed pull under
  ``kv_load_failure_policy: reprefill`` (or a failed early pull) goes to REPREFILL.
- REPREFILL: another prefill node computes the KV again (its first token is dropped: the client
  has one); with none left, decode recomputes the prompt itself (a DECODE without a transfer).

The leg calls (gRPC, the Steps stream, aborts) are the ``LegClient``'s: ``PDBackend`` in the
router, a fake in the unit tests of this module.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, Protocol

import grpc

from pdserve.engine.outputs import GenerationDelta
from pdserve.errors import CapacityError, InvalidRequestError
from services.router.backend import BackendRequest
from services.router.nodes import NodeHandle, RouterPolicy, record_leg_result

logger = logging.getLogger(__name__)


class KVLoadFailedError(Exception):
    """Decode's KV pull failed and its policy is reprefill (or an early pull failed): the router
    re-runs the prefill leg."""


class Phase(enum.Enum):
    LOCAL = "local"
    PREFILL = "prefill"
    PREFILL_EARLY = "prefill_early"  # the prefill leg with the decode leg already open
    DECODE = "decode"
    DECODE_EARLY = "decode_early"  # reading the decode leg opened in PREFILL_EARLY
    REPREFILL = "reprefill"
    DONE = "done"


class LegClient(Protocol):
    """The calls a flow makes; ``PDBackend`` implements them over gRPC and the Steps stream."""

    prefill: list[NodeHandle]
    policy: RouterPolicy

    def pick(
        self, nodes: list[NodeHandle], key: bytes | None, exclude: frozenset[str] | set[str] = frozenset()
    ) -> NodeHandle:
        """A node of ``nodes`` not in ``exclude`` (CapacityError if none is available)."""
        ...

    def count_path(self, path: str) -> None:
        """pdserve:router_requests_by_path{path}."""
        ...

    def count_leg_failure(self, role: str, code: str) -> None:
        """pdserve:router_leg_failures{role, code}."""
        ...

    async def prefill_leg(
        self, p: NodeHandle, req: BackendRequest, transfer_id: str, d_pp: int, d_tp: int = 1
    ) -> GenerationDelta:
        """P.Prefill: the first token, the KV held under ``transfer_id``; AioRpcError on failure."""
        ...

    def decode_leg(
        self,
        d: NodeHandle,
        req: BackendRequest,
        transfer_id: str | None,
        p: NodeHandle | None,
        first_tokens: list[int],
        early: Any = None,
    ) -> AsyncGenerator[GenerationDelta, None]:
        """The decode leg's deltas (``early``: read the leg ``open_early_leg`` opened); raises
        KVLoadFailedError when decode's pull failed under the reprefill policy."""
        ...

    def open_early_leg(self, d: NodeHandle, req: BackendRequest, transfer_id: str, p: NodeHandle) -> Any:
        """Open the decode leg before the prefill leg's answer; its handle for ``decode_leg``."""
        ...

    async def drop_early_leg(self, d: NodeHandle, early: Any) -> None:
        """Stop an early leg nobody will read and abort it on the node."""
        ...

    async def abort_prefill(self, p: NodeHandle, transfer_id: str) -> None:
        """P.Abort: prefill frees the KV held under ``transfer_id`` now."""
        ...


class PDFlow:
    """One sequence of one request through the states above. ``local`` (the path chosen before
    the flow: prefill on the decode node) starts in LOCAL; otherwise in PREFILL_EARLY where the
    early leg applies, else PREFILL. Create one per sequence and iterate ``run()`` once."""

    def __init__(
        self,
        legs: LegClient,
        req: BackendRequest,
        d_node: NodeHandle,
        key: bytes | None,
        *,
        local: bool,
        on_done: Callable[[], None],
    ) -> None:
        self.legs = legs
        self.req = req
        self.d_node = d_node
        self.key = key  # the prefix-affinity key of the prompt (None: no affinity)
        self.on_done = on_done  # a normal end of a path that should remember the prompt's blocks
        self.tried: set[str] = set()  # prefill nodes this request used or failed on
        self.transfer_id = uuid.uuid4().hex  # the first prefill leg's
        self.first: GenerationDelta | None = None  # the first token, from the prefill leg
        self.leg: tuple[NodeHandle, str] | None = None  # the KV the next decode leg pulls
        self.early: Any = None  # the early decode leg while PREFILL_EARLY / DECODE_EARLY hold it
        self.held: list[tuple[NodeHandle, str]] = []  # prefill legs that answered (their epochs)
        self.history: list[Phase] = []  # every state entered, in order (tests, logs)
        self.chosen_local = local  # LOCAL by choice (its blocks remembered), not as a fallback
        if local:
            self.phase = Phase.LOCAL
            legs.count_path("local")
        else:
            legs.count_path("disaggregated")
            # an adapter request's decode leg carries the identity prefill answers with
            early_ok = legs.policy.pd_decode_leg == "with_prefill" and not req.mm_items and not req.lora_name
            self.phase = Phase.PREFILL_EARLY if early_ok else Phase.PREFILL
        self.history.append(self.phase)

    def _goto(self, phase: Phase) -> None:
        assert self.phase is not Phase.DONE, "a finished flow does not move"
        self.phase = phase
        self.history.append(phase)

    async def run(self) -> AsyncIterator[GenerationDelta]:
        handlers = {
            Phase.LOCAL: self._local,
            Phase.PREFILL: self._prefill,
            Phase.PREFILL_EARLY: self._prefill,
            Phase.DECODE: self._decode,
            Phase.DECODE_EARLY: self._decode,
            Phase.REPREFILL: self._reprefill,
        }
        try:
            while self.phase is not Phase.DONE:
                async for d in handlers[self.phase]():
                    yield d
        finally:
            if self.early is not None:  # cancelled, failed or left before the early leg was read
                early, self.early = self.early, None
                await asyncio.shield(self.legs.drop_early_leg(self.d_node, early))
            for p, tid in self.held:  # a Prefill answer's epoch that no decode leg read
                p.epoch_by_transfer.pop(tid, None)

    # -- the states -----------------------------------------------------------------------------
    async def _local(self) -> AsyncIterator[GenerationDelta]:
        """LOCAL -> DONE: the decode node prefills and decodes; nothing moves."""
        async for d in self.legs.decode_leg(self.d_node, self.req, None, None, []):
            yield d
        self._goto(Phase.DONE)
        if self.chosen_local:  # a fallback from a prefill state does not remember the blocks
            self.on_done()

    async def _prefill(self) -> AsyncIterator[GenerationDelta]:
        """PREFILL(_EARLY) -> DECODE(_EARLY) | DONE (the first token ended it) | PREFILL (the next
        node) | LOCAL (none left); a 4xx-like failure raises."""
        legs, req = self.legs, self.req
        p = legs.pick(legs.prefill, self.key, self.tried)
        if self.phase is Phase.PREFILL_EARLY:
            self.early = legs.open_early_leg(self.d_node, req, self.transfer_id, p)
        self.tried.add(p.name)
        try:
            first = await legs.prefill_leg(p, req, self.transfer_id, self.d_node.pp_size, self.d_node.tp_size)
        except grpc.aio.AioRpcError as e:
            await self._drop_early()  # its pull would wait for KV that is not coming
            self._prefill_failed(p, e)
            return
        p.breaker.record_success()
        self.first, self.leg = first, (p, self.transfer_id)
        self.held.append(self.leg)
        yield first
        if first.finish_reason is not None:  # EOS or max_tokens=1: nobody will pull
            await self._drop_early()
            await legs.abort_prefill(p, self.transfer_id)
            self._goto(Phase.DONE)
            return
        self._goto(Phase.DECODE_EARLY if self.early is not None else Phase.DECODE)

    def _prefill_failed(self, p: NodeHandle, e: grpc.aio.AioRpcError) -> None:
        """A failed prefill leg: raise what the client should see, or move to the next node."""
        code, req = e.code(), self.req
        self.legs.count_leg_failure("prefill", code.name)
        record_leg_result(p, code)
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise InvalidRequestError(e.details() or "invalid request") from e
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise CapacityError(e.details() or "prefill node is full") from e
        if req.mm_items and code == grpc.StatusCode.FAILED_PRECONDITION:
            # The image's embedding could not be fetched (encoder gone, entry expired).
            raise CapacityError(e.details() or "image embeddings unavailable") from e
        p.healthy = code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        logger.warning(
            "prefill leg of %s on %s failed: %s %s", req.request_id, p.name, code.name, e.details()
        )
        if len(self.tried) < len(self.legs.prefill):
            self._goto(Phase.PREFILL)  # the next node, serially (the early leg is gone)
            return
        if req.mm_items:
            raise CapacityError(
                f"every prefill node failed this image request (last: {p.name}: {code.name}); retry later"
            ) from e
        self.legs.count_path("local_fallback")  # prefill on the decode node instead (no transfer)
        self._goto(Phase.LOCAL)

    async def _decode(self) -> AsyncIterator[GenerationDelta]:
        """DECODE(_EARLY) -> DONE | REPREFILL (decode's pull failed)."""
        assert self.first is not None
        early, self.early = self.early, None  # the decode leg owns it from here
        p, tid = self.leg if self.leg is not None else (None, None)
        try:
            async for d in self.legs.decode_leg(self.d_node, self.req, tid, p, self.first.token_ids, early):
                yield d
        except KVLoadFailedError:
            self._goto(Phase.REPREFILL)
            return
        self._goto(Phase.DONE)
        self.on_done()

    async def _reprefill(self) -> AsyncIterator[GenerationDelta]:
        """REPREFILL -> DECODE: a new prefill leg on a node not tried yet, or none (decode
        recomputes the prompt: a decode leg without a transfer). Yields nothing."""
        legs, req = self.legs, self.req
        self.leg = None
        while len(self.tried) < len(legs.prefill):
            p = legs.pick(legs.prefill, self.key, self.tried)
            self.tried.add(p.name)
            tid = uuid.uuid4().hex
            try:
                # Its sampled token is dropped: the client has the first one, decode gets that one.
                await legs.prefill_leg(p, req, tid, self.d_node.pp_size, self.d_node.tp_size)
            except grpc.aio.AioRpcError as e:
                legs.count_leg_failure("prefill", e.code().name)
                record_leg_result(p, e.code())
                continue
            p.breaker.record_success()
            legs.count_path("reprefill")
            self.leg = (p, tid)
            self.held.append(self.leg)
            break
        else:
            if req.mm_needs_ec:
                raise CapacityError("the KV pull failed and no other prefill node can fetch the images")
            legs.count_path("reprefill_local")
        self._goto(Phase.DECODE)
        return
        yield  # an async generator like the other states

    async def _drop_early(self) -> None:
        if self.early is not None:
            early, self.early = self.early, None
            await self.legs.drop_early_leg(self.d_node, early)
