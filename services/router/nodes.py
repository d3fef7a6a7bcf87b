"""The router's view of its nodes: handles, load polling, choosing a node (``NodePool``).

``PDBackend`` (services/router/pd_backend.py) runs the request lifecycle on top of this; the
discovery (services/router/discovery.py) rewrites ``prefill`` / ``decode`` in place.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.errors import CapacityError
from pdserve.kvevents.index import PrefixIndex
from pdserve.rpc import channel
from pdserve.rpc import node_pb2 as pb
from pdserve.rpc import node_pb2_grpc as pb_grpc
from services.router import cache_aware
from services.router.breaker import CircuitBreaker, is_node_fault
from services.router.cache_aware import CacheAwareWeights, RouteKey
from services.router.route_info import note_route
from services.router.step_mux import STEPS_CONNECT_TIMEOUT_S, SocketSteps, StepMux, status_error

logger = logging.getLogger(__name__)
LOAD_POLL_S = 0.5
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
    in_flight_at_report: int = 0  # in_flight when that GetLoad answered (load_estimate)
    block_size: int = 16
    num_blocks_total: int = 0  # from GetLoad: the node's KV cache (0 until a report)
    kv_blocks_used: int = 0  # from GetLoad (its first stage's): blocks in use
    transfers_in_flight: int = 0  # from GetLoad: KV pushes (prefill) or pulls (decode) under way
    prefix_cache_queried_blocks: int = 0  # from GetLoad: since the node started
    prefix_cache_hit_blocks: int = 0
    lora_idents: dict[str, str] = field(default_factory=dict)  # its last load report's adapters
    seen_prefixes: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    epoch: str = ""  # from GetLoad; a change means the node restarted
    epoch_by_transfer: dict[str, str] = field(default_factory=dict)  # Prefill's answer, until Decode
    pp_size: int = 1  # pipeline stages, from GetLoad's stage list (the prefill's need_send)
    tp_size: int = 1  # TP ranks, from GetLoad's stage list (the prefill's need_send)
    mux: StepMux | None = None  # decode-capable nodes: the shared Steps stream (made on first use)
    steps_socket: str = ""  # GetLoad's steps_socket: where the node's Steps streams go ("host:port")

    @property
    def available(self) -> bool:
        """In rotation: answers GetLoad and its breaker lets a request through."""
        return self.healthy and self.breaker.available()

    @property
    def load(self) -> int:
        """The node's sequences as this router sees them: ``load_estimate`` (the node's report
        already holds this router's sequences, so in_flight + reported_load counted them twice)."""
        return self.load_estimate

    @property
    def load_estimate(self) -> int:
        """This router's sequences now, plus what the last report had beyond its own then (other
        routers' work): a report up to LOAD_POLL_S old no longer counts our finished ones."""
        return self.in_flight + max(0, self.reported_load - self.in_flight_at_report)

    def remember_prefix(self, h: bytes) -> None:
        self.seen_prefixes[h] = None
        self.seen_prefixes.move_to_end(h)
        while len(self.seen_prefixes) > SEEN_PREFIXES_PER_NODE:
            self.seen_prefixes.popitem(last=False)


@dataclass(frozen=True)
class RouterPolicy:
    policy: str = "least_loaded"  # least_loaded | prefix_affinity | round_robin | cache_aware
    cache_aware: CacheAwareWeights = field(default_factory=CacheAwareWeights)  # policy cache_aware
    local_prefill_max_tokens: int = 32
    local_prefill_min_hit_frac: float = 0.9  # decode node already saw this much of the prompt
    prefill_timeout_s: float = 30.0  # P.Prefill call -> first token with the KV held
    request_timeout_s: float = 600.0
    decode_first_token_timeout_s: float = 30.0  # D.Decode call -> first delta (queue + KV pull)
    inter_token_timeout_s: float = 15.0  # between two deltas of a decode stream
    breaker_failures: int = 3
    breaker_open_s: float = 5.0
    nonstream_flush_ms: int = 100  # BackendRequest.streamed false: node-side batching
    stream_flush_ms: int = 0  # streamed: the same batching when > 0 (router.stream_flush_ms)
    # with_prefill: a P/D request's decode leg opens with its prefill leg;
    # after_prefill: once the first token is back (router.pd_decode_leg)
    pd_decode_leg: str = "after_prefill"

    def __post_init__(self) -> None:
        if self.pd_decode_leg not in ("with_prefill", "after_prefill"):
            raise ValueError(f"pd_decode_leg {self.pd_decode_leg!r}: use with_prefill or after_prefill")


class NodePool:
    """The prefill and decode nodes the router routes to: a handle each (channel, breaker, load,
    Steps stream), their loads polled every ``LOAD_POLL_S``, and the choice of one for a leg."""

    def __init__(
        self,
        prefill: list[tuple[str, str]],
        decode: list[tuple[str, str]],
        policy: RouterPolicy,
        shared_token: str | None,
        reg: CollectorRegistry,
    ) -> None:
        self.policy = policy
        self._md = channel.auth_metadata(shared_token)
        self._token = shared_token
        self.prefill = [self.new_handle(n, a, "prefill") for n, a in prefill]
        self.decode = [self.new_handle(n, a, "decode") for n, a in decode]
        self._rr: dict[str, int] = {}  # round_robin: a turn counter per role (prefill, decode)
        self.prefix_index: PrefixIndex | None = None  # cache_aware: filled by KV events
        # LoRA adapter name -> identity (name@hash) the nodes reported (load reports, prefill
        # answers, loads through the router); its hash salts the adapter's block hashes
        # (services/router/lora.py)
        self.lora_idents: dict[str, str] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # background work (aborts, closing channels)
        self._poller: asyncio.Task[None] | None = None
        self._closing = False
        self.node_load = Gauge(
            "pdserve:router_node_load",
            "Sequences per node as the router sees them.",
            ["node"],
            registry=reg,
            multiprocess_mode="livemax",  # router workers: the largest view
        )
        self.node_restarts = Counter(
            "pdserve:router_node_restarts",
            "New epochs seen in a node's GetLoad (restarts).",
            ["node"],
            registry=reg,
        )
        self.node_in_rotation = Gauge(
            "pdserve:router_node_in_rotation",
            "1 while the node answers GetLoad and its circuit breaker is not open.",
            ["node"],
            registry=reg,
            multiprocess_mode="livemin",  # router workers: 0 if any worker took it out
        )
        self.steps_streams_opened = Counter(
            "pdserve:router_steps_streams_opened",
            "Steps streams (token streams) opened to a node: one per router process and node while "
            "it lives, one more after each break or node restart.",
            ["node"],
            registry=reg,
        )
        self.steps_legs_broken = Counter(
            "pdserve:router_steps_legs_broken",
            "Decode legs failed because their node's Steps stream ended under them (node gone, "
            "connection lost, a stream_end from the node).",
            ["node"],
            registry=reg,
        )

    # -- node state ------------------------------------------------------------------------------
    def new_handle(self, name: str, addr: str, role: str) -> NodeHandle:
        """A node's handle with its own channel and circuit breaker (static list and discovery)."""
        return NodeHandle(
            name,
            role,
            addr,
            grpc.aio.insecure_channel(addr, options=channel.OPTIONS),
            breaker=CircuitBreaker(self.policy.breaker_failures, self.policy.breaker_open_s),
        )

    def start(self) -> None:
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll_loads())

    async def close(self) -> None:
        self._closing = True  # the poller stops at its next round even if the cancel is lost
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        await asyncio.gather(*self._tasks, return_exceptions=True)  # the background aborts
        for n in self.prefill + self.decode:
            if n.mux is not None:
                await n.mux.close()
            await n.channel.close()

    def _learn_lora_idents(self, n: NodeHandle, reported: dict[str, str]) -> None:
        """Take a node's reported adapters; forget a name no node reports any more (unloaded
        everywhere), so an adapter loaded again later is salted by its new content."""
        gone = n.lora_idents.keys() - reported.keys()
        n.lora_idents = reported
        self.lora_idents.update(reported)
        for name in gone:
            if not any(name in m.lora_idents for m in (*self.prefill, *self.decode)):
                self.lora_idents.pop(name, None)

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
            n.in_flight_at_report = n.in_flight
            n.block_size = rep.block_size or n.block_size
            n.num_blocks_total = rep.num_blocks_total
            n.pp_size = max(1, len({s.stage.pp_rank for s in rep.stages}))
            n.tp_size = max([1, *(s.stage.tp_size for s in rep.stages)])
            n.kv_blocks_used = rep.stages[0].blocks_used if rep.stages else 0
            n.transfers_in_flight = rep.num_pushes_in_flight + rep.num_pulls_in_flight
            n.prefix_cache_queried_blocks = rep.prefix_cache_queried_blocks
            n.prefix_cache_hit_blocks = rep.prefix_cache_hit_blocks
            self._learn_lora_idents(n, dict(rep.lora_idents))
            if rep.steps_socket != n.steps_socket:
                # A (re)started node with another Steps port: the next leg opens its Steps
                # stream there (a stream still open ends with its node).
                n.steps_socket = rep.steps_socket
                n.mux = None
            if rep.epoch and rep.epoch != n.epoch:
                if n.epoch:
                    note_new_epoch(n, rep.epoch)
                    self.node_restarts.labels(n.name).inc()
                n.epoch = rep.epoch
        except grpc.aio.AioRpcError as e:
            task = asyncio.current_task()
            if e.code() == grpc.StatusCode.CANCELLED and task is not None and task.cancelling():
                # close() cancelled the poller mid-call: grpc reports it as a CANCELLED status,
                # and swallowing that here left close() waiting for a poller that polled on.
                raise asyncio.CancelledError from e
            n.healthy = False
        self.node_load.labels(n.name).set(n.load)
        self.node_in_rotation.labels(n.name).set(1 if n.available else 0)

    async def _poll_loads(self) -> None:
        while not self._closing:
            try:
                await asyncio.gather(*(self._poll_one(n) for n in self.prefill + self.decode))
            except Exception:  # keep polling: one bad answer must not blind the router
                logger.exception("load poll failed")
            await asyncio.sleep(LOAD_POLL_S)

    def kv_capacity_tokens(self) -> int | None:
        """The fewest tokens one request may hold on any node that reported its KV cache (a node
        whose cache is smaller than the checkpoint's length serves only that much: engine/kv_sizing.py);
        None before any report."""
        sizes = [
            n.num_blocks_total * n.block_size for n in (*self.prefill, *self.decode) if n.num_blocks_total
        ]
        return min(sizes) if sizes else None

    async def check_capacity(self) -> None:
        self.start()
        if not any(n.available for n in self.decode):
            # The last poll may predate a node's start: ask once more before refusing.
            await asyncio.gather(*(self._poll_one(n) for n in self.decode))
            if not any(n.available for n in self.decode):
                raise CapacityError("no decode node is reachable; retry later")

    async def ready(self) -> bool:
        """A request can be served now, by the paths ``generate`` takes: a decode node is in
        rotation. Prefill nodes are not required: without one, prompts prefill on decode
        (local / local_fallback), so a prefill outage changes the path, not readiness."""
        await asyncio.gather(*(self._poll_one(n) for n in self.prefill + self.decode if not n.healthy))
        return any(n.available for n in self.decode)

    # -- choosing nodes ---------------------------------------------------------------------------
    def pick(
        self, nodes: list[NodeHandle], key: bytes | None, exclude: frozenset[str] | set[str] = frozenset()
    ) -> NodeHandle:
        live = [n for n in nodes if n.available and n.name not in exclude] or [
            n for n in nodes if n.healthy and n.name not in exclude
        ]
        if not live:
            live = [n for n in nodes if n.name not in exclude]  # last resort: try even a down node
        if not live:
            raise CapacityError("no node available for this request; retry later")
        if (
            self.policy.policy == "cache_aware"
            and isinstance(key, RouteKey)
            and self.prefix_index is not None
        ):
            chosen, held = cache_aware.choose(live, key, self.prefix_index, self.policy.cache_aware)
            note_route(f"{chosen.role}-prefix-hit-tokens", held * chosen.block_size)
        elif self.policy.policy == "prefix_affinity" and key is not None:
            # Rendezvous hashing: the same leading blocks land on the same node while it lives.
            chosen = max(live, key=lambda n: hashlib.blake2b(key + n.name.encode(), digest_size=8).digest())
        elif self.policy.policy == "round_robin":
            turn = self._rr[nodes[0].role] = self._rr.get(nodes[0].role, -1) + 1
            chosen = live[turn % len(live)]
        else:
            chosen = min(live, key=lambda n: n.load)
        chosen.breaker.on_dispatch()  # claims the half-open probe, if it is one
        note_route(f"{chosen.role}-node", chosen.name)
        return chosen

    def steps_mux(self, n: NodeHandle) -> StepMux:
        """``n``'s Steps stream, made on first use (and again after the node's Steps port moved)."""
        if n.mux is None:
            opened, broken = self.steps_streams_opened.labels(n.name), self.steps_legs_broken.labels(n.name)
            n.mux = StepMux(self._steps_connector(n), on_open=opened.inc, on_break=broken.inc)
        return n.mux

    def _steps_connector(self, n: NodeHandle) -> Callable[[], Awaitable[SocketSteps]]:
        """How ``n``'s StepMux opens a stream: a connection to its Steps socket, at the address
        its GetLoad reports (asked here when no poll has answered yet: a leg right after start)."""
        token, md = self._token, self._md

        async def connect() -> SocketSteps:
            if not n.steps_socket:
                rep = await pb_grpc.DecodeServiceStub(n.channel).GetLoad(
                    pb.LoadRequest(), timeout=STEPS_CONNECT_TIMEOUT_S, metadata=md
                )
                n.steps_socket = rep.steps_socket
            if not n.steps_socket:
                raise status_error(
                    grpc.StatusCode.UNAVAILABLE,
                    f"node {n.name} reports no Steps socket: is it a decode or colocated node?",
                )
            return await SocketSteps.connect(n.steps_socket, token)

        return connect


def record_leg_result(n: NodeHandle, code: grpc.StatusCode) -> None:
    """A leg failed with ``code``: only node faults move the breaker (4xx / 429 are the request's)."""
    if is_node_fault(code):
        n.breaker.record_failure()


def note_new_epoch(n: NodeHandle, epoch: str) -> None:
    """The node restarted: its prefix cache is empty and its old failures are the old process's."""
    logger.warning("node %s restarted (epoch %s -> %s)", n.name, n.epoch, epoch)
    n.seen_prefixes.clear()
    n.breaker.reset()
