"""The router's real backend: runs the request lifecycle over prefill and decode nodes (DESIGN §2).

    ACCEPTED -> DISPATCHED(P, D, transfer_id) -> STREAMING -> DONE | FAILED | CANCELLED

1. pick a path: prompts shorter than ``local_prefill_max_tokens`` (or whose leading blocks the
   decode node has recently seen) are prefilled on the decode node; the rest go to a prefill node;
2. P.Prefill(transfer_id) returns the first token while P holds the KV under a lease;
3. D.Decode(transfer_id, first token) pulls the KV from P and streams the rest;
4. on client disconnect, error or timeout the other leg is cancelled at once (P.Abort / D.Abort).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.engine.block_pool import hash_prompt_blocks
from pdserve.engine.outputs import GenerationDelta
from pdserve.errors import CapacityError, InvalidRequestError
from pdserve.rpc import channel, convert
from pdserve.rpc import node_pb2 as pb
from pdserve.rpc import node_pb2_grpc as pb_grpc
from services.router.backend import BackendRequest

logger = logging.getLogger(__name__)
LOAD_POLL_S = 0.5
AFFINITY_BLOCKS = 4  # leading blocks that decide prefix affinity
SEEN_PREFIXES_PER_NODE = 4096


@dataclass
class NodeHandle:
    name: str
    role: str  # prefill | decode | colocated
    address: str
    channel: grpc.aio.Channel
    healthy: bool = False  # until a GetLoad answers
    in_flight: int = 0  # sequences the router has on this node now
    reported_load: int = 0  # running + waiting, from the node's last GetLoad
    block_size: int = 16
    seen_prefixes: OrderedDict[bytes, None] = field(default_factory=OrderedDict)

    @property
    def load(self) -> int:
        return self.in_flight + self.reported_load

    def remember_prefix(self, h: bytes) -> None:
        self.seen_prefixes[h] = None
        self.seen_prefixes.move_to_end(h)
        while len(self.seen_prefixes) > SEEN_PREFIXES_PER_NODE:
            self.seen_prefixes.popitem(last=False)


@dataclass(frozen=True)
class RouterPolicy:
    policy: str = "least_loaded"  # least_loaded | prefix_affinity | round_robin
    local_prefill_max_tokens: int = 32
    local_prefill_min_hit_frac: float = 0.9  # decode node already saw this much of the prompt
    prefill_timeout_s: float = 120.0
    request_timeout_s: float = 600.0


class PDBackend:
    """Implements ``GenerateBackend`` over gRPC. Create inside the serving event loop."""

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
        self.policy = policy or RouterPolicy()
        self._md = channel.auth_metadata(shared_token)

        def handle(name: str, addr: str, role: str) -> NodeHandle:
            return NodeHandle(name, role, addr, grpc.aio.insecure_channel(addr, options=channel.OPTIONS))

        self.prefill = [handle(n, a, "prefill") for n, a in prefill]
        self.decode = [handle(n, a, "decode") for n, a in decode]
        self._rr = 0
        self._poller: asyncio.Task[None] | None = None
        reg = registry if registry is not None else CollectorRegistry()
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
        self.node_load = Gauge(
            "pdserve:router_node_load", "Sequences per node as the router sees them.", ["node"], registry=reg
        )

    # -- node state ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll_loads())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        for n in self.prefill + self.decode:
            await n.channel.close()

    async def _poll_one(self, n: NodeHandle) -> None:
        stub = (
            pb_grpc.PrefillServiceStub(n.channel)
            if n.role == "prefill"
            else pb_grpc.DecodeServiceStub(n.channel)
        )
        try:
            rep = await stub.GetLoad(pb.LoadRequest(), timeout=2.0, metadata=self._md, wait_for_ready=True)
            n.healthy = True
            n.reported_load = rep.num_running + rep.num_waiting
            n.block_size = rep.block_size or n.block_size
        except grpc.aio.AioRpcError:
            n.healthy = False
        self.node_load.labels(n.name).set(n.load)

    async def _poll_loads(self) -> None:
        while True:
            try:
                await asyncio.gather(*(self._poll_one(n) for n in self.prefill + self.decode))
            except Exception:  # keep polling: one bad answer must not blind the router
                logger.exception("load poll failed")
            await asyncio.sleep(LOAD_POLL_S)

    async def check_capacity(self) -> None:
        self.start()
        if not any(n.healthy for n in self.decode):
            # The last poll may predate a node's start: ask once more before refusing.
            await asyncio.gather(*(self._poll_one(n) for n in self.decode))
            if not any(n.healthy for n in self.decode):
                raise CapacityError("no decode node is reachable; retry later")

    async def ready(self) -> bool:
        """Every role can take work: a decode node and (when configured) a prefill node answer."""
        await asyncio.gather(*(self._poll_one(n) for n in self.prefill + self.decode if not n.healthy))
        return any(n.healthy for n in self.decode) and (
            not self.prefill or any(n.healthy for n in self.prefill)
        )

    # -- choosing nodes ---------------------------------------------------------------------------
    def _pick(
        self, nodes: list[NodeHandle], key: bytes | None, exclude: frozenset[str] | set[str] = frozenset()
    ) -> NodeHandle:
        live = [n for n in nodes if n.healthy and n.name not in exclude] or [
            n for n in nodes if n.name not in exclude
        ]
        if not live:
            raise CapacityError("no node available for this request; retry later")
        if self.policy.policy == "prefix_affinity" and key is not None:
            # Rendezvous hashing: the same leading blocks land on the same node while it lives.
            return max(live, key=lambda n: hashlib.blake2b(key + n.name.encode(), digest_size=8).digest())
        if self.policy.policy == "round_robin":
            self._rr += 1
            return live[self._rr % len(live)]
        return min(live, key=lambda n: n.load)

    def prefill_locally(self, req: BackendRequest, hashes: list[bytes], d_node: NodeHandle) -> bool:
        """Conditional disaggregation: prefill on the decode node when the prompt is short, when
        the decode node recently saw (nearly) all of its blocks, or when there is no prefill node."""
        if not self.prefill or req.num_prompt_tokens < self.policy.local_prefill_max_tokens:
            return True
        seen = sum(1 for h in hashes if h in d_node.seen_prefixes)
        return bool(hashes) and seen >= self.policy.local_prefill_min_hit_frac * len(hashes)

    # -- the lifecycle --------------------------------------------------------------------------
    async def generate(self, req: BackendRequest) -> AsyncGenerator[GenerationDelta, None]:
        self.start()
        ids = req.prompt_token_ids
        bs = self.decode[0].block_size
        # Embeddings have no token ids to hash: no affinity, no "seen on decode" shortcut.
        hashes = hash_prompt_blocks(ids, bs) if req.prompt_embeds is None else []
        key = hashes[min(len(hashes), AFFINITY_BLOCKS) - 1] if hashes else None
        d_node = self._pick(self.decode, key)
        if self.prefill_locally(req, hashes, d_node):
            self.path_total.labels("local").inc()
            async for d in self._decode_leg(d_node, req, None, None, []):
                yield d
            for h in hashes:
                d_node.remember_prefix(h)
            return
        self.path_total.labels("disaggregated").inc()
        transfer_id = uuid.uuid4().hex
        tried: set[str] = set()
        first: GenerationDelta | None = None
        p_node: NodeHandle | None = None
        while first is None:
            p_node = self._pick(self.prefill, key, tried)
            tried.add(p_node.name)
            try:
                first = await self._prefill_leg(p_node, req, transfer_id)
            except grpc.aio.AioRpcError as e:
                self.leg_failures.labels("prefill", e.code().name).inc()
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidRequestError(e.details() or "invalid request") from e
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise CapacityError(e.details() or "prefill node is full") from e
                p_node.healthy = e.code() not in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                )
                logger.warning(
                    "prefill leg of %s on %s failed: %s %s",
                    req.request_id,
                    p_node.name,
                    e.code().name,
                    e.details(),
                )
                if len(tried) >= len(self.prefill):
                    # Every prefill node failed: prefill on the decode node instead (no transfer).
                    self.path_total.labels("local_fallback").inc()
                    async for d in self._decode_leg(d_node, req, None, None, []):
                        yield d
                    return
        assert p_node is not None
        yield first
        if first.finish_reason is not None:
            await self._abort_prefill(p_node, transfer_id)  # EOS or max_tokens=1: nobody will pull
            return
        async for d in self._decode_leg(d_node, req, transfer_id, p_node, first.token_ids):
            yield d
        for h in hashes:
            d_node.remember_prefix(h)

    async def _prefill_leg(self, p: NodeHandle, req: BackendRequest, transfer_id: str) -> GenerationDelta:
        stub = pb_grpc.PrefillServiceStub(p.channel)
        p.in_flight += 1
        try:
            call = stub.Prefill(
                pb.PrefillRequest(
                    transfer_id=transfer_id,
                    prompt_token_ids=req.prompt_token_ids,
                    sampling=convert.sampling_to_pb(req.sampling_params),
                    need_send=1,
                    prompt_embeds=_embeds_pb(req),
                ),
                timeout=self.policy.prefill_timeout_s,
                metadata=self._md,
            )
            try:
                resp = await call
            except asyncio.CancelledError:
                call.cancel()
                await self._abort_prefill(p, transfer_id)
                raise
        finally:
            p.in_flight -= 1
        d = convert.delta_from_pb(resp.first)
        d.request_id = req.request_id
        return d

    async def _decode_leg(
        self,
        d_node: NodeHandle,
        req: BackendRequest,
        transfer_id: str | None,
        p_node: NodeHandle | None,
        first_tokens: list[int],
    ) -> AsyncGenerator[GenerationDelta, None]:
        stub = pb_grpc.DecodeServiceStub(d_node.channel)
        msg = pb.DecodeRequest(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling=convert.sampling_to_pb(req.sampling_params),
            output_token_ids=first_tokens,
            remote_prefill=transfer_id is not None,
            transfer_id=transfer_id or "",
            prefill_address=p_node.address if p_node else "",
            # Decode needs the embeddings only if it prefills (local path, or recompute after a
            # failed pull); sent always so the recompute policy stays correct.
            prompt_embeds=_embeds_pb(req),
        )
        d_node.in_flight += 1
        call = stub.Decode(msg, timeout=self.policy.request_timeout_s, metadata=self._md)
        finished = errored = streamed = False
        try:
            async for m in call:
                streamed = True
                d = convert.delta_from_pb(m)
                d.request_id = req.request_id
                finished = d.finish_reason is not None
                errored = d.finish_reason == "error"
                yield d
                if finished:
                    return
            if not finished:
                finished = errored = True
                yield _error_delta(req, "decode node closed the stream without finishing")
        except grpc.aio.AioRpcError as e:
            self.leg_failures.labels("decode", e.code().name).inc()
            logger.warning(
                "decode leg of %s on %s failed: %s %s",
                req.request_id,
                d_node.name,
                e.code().name,
                e.details(),
            )
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT and transfer_id is None:
                raise InvalidRequestError(e.details() or "invalid request") from e
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                d_node.healthy = False
                if transfer_id is None and not finished and not streamed:
                    # Refused before anything reached the client (a draining or gone node): a
                    # retryable 503, not a failed generation (GenerateBackend's contract).
                    finished = True  # nothing was admitted, nothing to abort
                    raise CapacityError(
                        f"decode node {d_node.name} unavailable: {e.details()}; retry later"
                    ) from e
            finished = errored = True
            yield _error_delta(req, f"decode failed: {e.code().name}: {e.details()}")
        finally:
            d_node.in_flight -= 1
            if not finished:
                # Client gone (cancellation / aclose): cancel both legs at once.
                call.cancel()
                await asyncio.shield(self._abort_both(d_node, req.request_id, p_node, transfer_id))
            elif errored and p_node is not None and transfer_id is not None:
                # Decode failed (maybe before its pull): make sure prefill lets go of the KV now.
                await asyncio.shield(self._abort_prefill(p_node, transfer_id))

    async def _abort_prefill(self, p: NodeHandle, transfer_id: str) -> None:
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


def _embeds_pb(req: BackendRequest) -> pb.Tensor | None:
    return convert.tensor_to_pb(req.prompt_embeds) if req.prompt_embeds is not None else None


def _error_delta(req: BackendRequest, message: str) -> GenerationDelta:
    return GenerationDelta(
        request_id=req.request_id,
        token_ids=[],
        text="",
        finish_reason="error",
        error=message,
        num_prompt_tokens=req.num_prompt_tokens,
    )
