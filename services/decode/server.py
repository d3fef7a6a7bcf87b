"""The decode node: receives KV from prefill, generates the rest, streams tokens.

Also serves colocated requests (``remote_prefill`` false): prefill runs here, nothing moves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from prometheus_client import Histogram

from pdserve.distributed.pp_stage import StageEndpoint
from pdserve.engine.outputs import GenerationDelta
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler_output import KVLoadSpec
from pdserve.errors import PdserveError
from pdserve.kvtransfer.checksum import kv_blocks_digest
from pdserve.kvtransfer.handshake import HandshakeError, HandshakeInfo, check_compat
from pdserve.kvtransfer.load_policy import KV_LOAD_FAILED_KEY, check_policy, engine_policy
from pdserve.kvtransfer.params import RemotePrefillParams
from pdserve.rpc import channel, convert
from pdserve.rpc import node_pb2 as pb
from pdserve.rpc import node_pb2_grpc as pb_grpc
from services.decode.keepalive import LeaseKeeper
from services.decode.outbox import Outbox
from services.mm_items import items_from_pb, to_engine_items
from services.node import NodeBase, NodeOptions
from services.prefill.server import handshake_from_pb, handshake_to_pb
from services.steps_direct import DirectSteps

logger = logging.getLogger(__name__)
# 1 ms .. 60 s: a pull on one host over TCP takes milliseconds, one queued behind many seconds.
KV_PULL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60)


class DecodeNode(NodeBase):
    def __init__(self, opts: NodeOptions) -> None:
        super().__init__(opts)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._peers: dict[str, HandshakeInfo] = {}  # prefill address -> its handshake (epoch)
        self._pulls: set[asyncio.Task[None]] = set()
        self.pull_bytes_total = 0
        self.pull_seconds_total = 0.0
        self.pull_failures_total = 0
        self.lease_keeper = LeaseKeeper(self, opts.kv_keepalive_s)
        check_policy(opts.kv_load_failure_policy)
        self.reprefill_ids: set[str] = set()  # failed pulls the router should re-prefill
        self.checksums_verified_total = 0
        self.checksum_mismatches_total = 0
        # Requests whose image items came without tensors: a failed pull cannot be recomputed here.
        self.no_recompute_ids: set[str] = set()
        # Decode legs opened with their prefill leg (first_token_from_prefill): the pull asks
        # prefill to wait for the KV and brings the first token; a failed one is the router's to
        # re-drive (it has that token), never recomputed here.
        self.early_ids: set[str] = set()
        self.early_pulls_total = 0
        self._last_checksum: dict[str, str] = {}  # transfer_id -> prefill's digest (kv_checksum)
        self.stage_pull_bytes = [0] * len(self.stages)  # per decode stage (metrics, GetLoad)
        self.stage_pull_failures = [0] * len(self.stages)
        self.stage_pulls = [0] * len(self.stages)
        self.kv_pull_seconds = Histogram(
            "pdserve:kv_pull_seconds",
            "Successful KV pulls: from the engine handing the pull over (its blocks allocated) to "
            "every stage's KV written (handshake and PushKV of all stages included).",
            ["node", "role"],
            buckets=KV_PULL_BUCKETS,
            registry=self.registry,
        ).labels(opts.name, opts.role)

    def stage_transfer_counters(self, pp_rank: int) -> tuple[int, int, int]:
        return (self.stage_pull_bytes[pp_rank], self.stage_pull_failures[pp_rank], self.stage_pulls[pp_rank])

    def add_servicers(self, server: grpc.aio.Server) -> None:
        self.steps_servicer = DecodeServicer(self)
        pb_grpc.add_DecodeServiceServicer_to_server(self.steps_servicer, server)

    def request_state_sizes(self) -> dict[str, int]:
        return {
            **super().request_state_sizes(),
            "decode.pulls": len(self._pulls),
            "decode.reprefill_ids": len(self.reprefill_ids),
            "decode.no_recompute_ids": len(self.no_recompute_ids),
            "decode.early_ids": len(self.early_ids),
            "decode.last_checksum": len(self._last_checksum),
        }

    def transfer_counters(self) -> list[tuple[str, str, float]]:
        return [
            ("kv_transfer_bytes", "KV bytes received from prefill nodes", self.pull_bytes_total),
            ("kv_transfer_seconds", "Seconds spent waiting for KV pushes", self.pull_seconds_total),
            ("kv_transfer_failures", "KV pulls that failed", self.pull_failures_total),
            (
                "kv_early_pulls",
                "KV pulls asked while the prompt was being prefilled (decode legs opened with their prefill leg)",
                self.early_pulls_total,
            ),
            *self.lease_keeper_counters(),
        ]

    def lease_keeper_counters(self) -> list[tuple[str, str, float]]:
        k = self.lease_keeper
        return [
            ("kv_keepalive_transfers", "Queued transfers whose prefill lease decode extended", k.sent_total),
            ("kv_keepalive_unknown", "Queued transfers prefill no longer held", k.unknown_total),
            ("kv_keepalive_failures", "KeepAlive calls to prefill nodes that failed", k.failures_total),
            (
                "kv_checksums_verified",
                "Pulled transfers whose checksum matched",
                self.checksums_verified_total,
            ),
            (
                "kv_checksum_mismatches",
                "Pulled transfers whose checksum did not match",
                self.checksum_mismatches_total,
            ),
        ]

    def forget_flags(self, request_id: str) -> None:
        """A request's decode leg ended: drop its per-request marks."""
        self.reprefill_ids.discard(request_id)
        self.no_recompute_ids.discard(request_id)
        self.early_ids.discard(request_id)

    def _verify(self, req: pb.PushKVRequest, checksum: str) -> tuple[bool, str]:
        return _verify_digest(self, req, checksum)

    def _stub(self, address: str) -> pb_grpc.PrefillServiceStub:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = grpc.aio.insecure_channel(address, options=channel.OPTIONS)
        return pb_grpc.PrefillServiceStub(ch)

    async def ensure_handshake(self, address: str) -> HandshakeInfo:
        """Compare KV compatibility with a prefill node once per (address, epoch)."""
        known = self._peers.get(address)
        if known is not None:
            return known
        resp = await self._stub(address).Handshake(
            pb.HandshakeRequest(info=handshake_to_pb(self.handshake)),
            timeout=10.0,
            metadata=channel.auth_metadata(self.opts.shared_token),
        )
        remote = handshake_from_pb(resp.info)
        check_compat(self.handshake, remote)
        self._peers[address] = remote
        return remote

    def _push_request(self, spec: KVLoadSpec, peer: HandshakeInfo, st: StageEndpoint) -> pb.PushKVRequest:
        p = spec.params
        return pb.PushKVRequest(
            transfer_id=p.transfer_id,
            dst_block_ids=spec.block_ids[: -(-spec.num_tokens // self.engine.kv.block_size)],
            num_tokens=spec.num_tokens,
            dst_regions=[pb.Region(**r.to_dict()) for r in st.regions],
            dst_session=st.session,
            dst_compat_hash=self.handshake.compat_hash,
            expected_src_epoch=peer.epoch,
            want_checksum=self.opts.kv_checksum,
            dst_pp_rank=st.pp_rank,
            dst_tp_rank=0,  # TP with KV transfer is refused at start
            dst_pp_size=st.pp_size,
            dst_layer_start=st.layer_start,
            dst_layer_end=st.layer_end,
            early=spec.request_id in self.early_ids,
        )

    async def _pull_stage(self, addr: str, req: pb.PushKVRequest) -> tuple[int, list[int]]:
        """One decode stage's PushKV: the bytes written and prefill's first token(s), or
        _PushFailed / AioRpcError."""
        resp = await self._stub(addr).PushKV(
            req,
            timeout=self.opts.kv_pull_timeout_s,
            metadata=channel.auth_metadata(self.opts.shared_token),
        )
        if req.transfer_id not in resp.ok:
            raise _PushFailed(
                f"prefill {addr} reported the write into decode stage {req.dst_pp_rank} as failed"
            )
        if resp.checksum:
            self._last_checksum[req.transfer_id] = resp.checksum
        return int(resp.bytes), list(resp.first_token_ids)

    # engine thread -> event loop: start the pulls a step asked for
    def _on_kv_loads(self, loads: list[KVLoadSpec]) -> None:
        assert self.loop is not None
        t = time.monotonic()  # the pulls' start, for kv_pull_seconds (the event loop may be busy)
        for spec in loads:
            self.loop.call_soon_threadsafe(self._start_pull, spec, t)

    def _start_pull(self, spec: KVLoadSpec, t_handed: float | None = None) -> None:
        task = asyncio.get_running_loop().create_task(self._pull(spec, t_handed))
        self._pulls.add(task)
        task.add_done_callback(self._pulls.discard)

    async def _pull(self, spec: KVLoadSpec, t_handed: float | None = None) -> None:
        p = spec.params
        addr = p.prefill_address
        ok, err = False, ""
        first: list[int] = []
        early = spec.request_id in self.early_ids
        self.early_pulls_total += early
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        t_start = time.monotonic() if t_handed is None else t_handed
        try:
            peer = self._peers.get(addr) or await self.ensure_handshake(addr)
            # One PushKV per decode stage, into that stage's regions and session; the
            # prefill node fans each out to its stages (kvtransfer.topology). The request runs only
            # when every stage has its KV; all pulls end before the blocks can be reused.
            reqs = [self._push_request(spec, peer, st) for st in self.stages]
            results = await asyncio.gather(*(self._pull_stage(addr, r) for r in reqs), return_exceptions=True)
            errors = []
            for st, r in zip(self.stages, results, strict=True):
                self.stage_pulls[st.pp_rank] += 1
                if isinstance(r, BaseException):
                    self.stage_pull_failures[st.pp_rank] += 1
                    errors.append(r)
                else:
                    self.stage_pull_bytes[st.pp_rank] += r[0]
                    first = first or r[1]
            if errors:
                raise errors[0]
            if early and not first:
                raise _PushFailed(f"prefill {addr} answered an early pull without the first token")
            ok = True
            self.pull_bytes_total += sum(r[0] for r in results if isinstance(r, tuple))
            if self.opts.kv_checksum:  # pp = 1 (kv_checksum with pp > 1 is refused at start)
                digest = self._last_checksum.get(p.transfer_id, "")
                ok, err = await asyncio.to_thread(self._verify, reqs[0], digest)
        except grpc.aio.AioRpcError as e:
            err = f"{e.code().name} from prefill {addr}: {e.details()}"
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                self._peers.pop(addr, None)  # re-handshake next time (restart / mismatch)
        except (HandshakeError, PdserveError) as e:
            err = str(e)
        except Exception as e:  # never leave the request waiting for KV: the policy applies
            logger.exception("KV pull %s: unexpected error", p.transfer_id)
            err = f"KV pull failed: {e!r}"
        finally:
            self._last_checksum.pop(p.transfer_id, None)
        self.pull_seconds_total += loop.time() - t0
        if ok:
            self.kv_pull_seconds.observe(time.monotonic() - t_start)
        else:
            self.pull_failures_total += 1
            logger.warning(
                "KV pull %s failed: %s (policy %s)", p.transfer_id, err, self.opts.kv_load_failure_policy
            )
        policy = engine_policy(self.opts.kv_load_failure_policy)
        if spec.request_id in self.no_recompute_ids or early:
            # images' embeddings not here / no first token here: recomputing would need them
            policy = "fail"
        if not ok and (self.opts.kv_load_failure_policy == "reprefill" or early):
            self.reprefill_ids.add(spec.request_id)  # read by Decode() when the error delta comes
        assert self.engine_loop is not None
        self.engine_loop.post_and_dispatch(
            lambda e: e.finish_kv_load(spec.request_id, ok, policy, err, first if early else ())
        )


class _PushFailed(PdserveError):
    """Prefill answered a stage's PushKV with the transfer in ``failed``."""


def _verify_digest(node: DecodeNode, req: pb.PushKVRequest, checksum: str) -> tuple[bool, str]:
    """Decode: the received blocks against prefill's digest (kv_checksum)."""
    if not checksum:
        return False, "prefill sent no checksum (kv_checksum is on here; is prefill older?)"
    if kv_blocks_digest(node.engine.runner.kv_cache, list(req.dst_block_ids)).hex() != checksum:
        node.checksum_mismatches_total += 1
        return False, f"KV checksum mismatch for {req.transfer_id}: the transfer was corrupted"
    node.checksums_verified_total += 1
    return True, ""


class DecodeServicer(pb_grpc.DecodeServiceServicer):
    def __init__(self, node: DecodeNode) -> None:
        self.node = node

    async def _open(self, request: pb.DecodeRequest) -> _Admission:
        """Check a DecodeRequest and handshake with its prefill node: what to admit on the engine;
        a refusal raises ``_Refusal`` with the gRPC status."""
        node = self.node
        try:
            params = convert.sampling_from_pb(request.sampling)
        except PdserveError as e:
            raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
        kv_params = None
        if request.remote_prefill:
            if not request.transfer_id or not request.prefill_address:
                raise _Refusal(
                    grpc.StatusCode.INVALID_ARGUMENT, "remote_prefill needs transfer_id and prefill_address"
                )
            if bool(request.output_token_ids) == request.first_token_from_prefill:
                raise _Refusal(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "remote_prefill needs the first token (output_token_ids), or first_token_from_prefill "
                    "without it (the pull brings it)",
                )
            known = node._peers.get(request.prefill_address)
            if known is not None and request.prefill_epoch and known.epoch != request.prefill_epoch:
                node._peers.pop(request.prefill_address, None)  # prefill restarted: handshake anew
            try:
                await node.ensure_handshake(request.prefill_address)
            except HandshakeError as e:
                raise _Refusal(grpc.StatusCode.FAILED_PRECONDITION, f"refused at handshake: {e}") from e
            except grpc.aio.AioRpcError as e:
                raise _Refusal(
                    grpc.StatusCode.UNAVAILABLE
                    if e.code() != grpc.StatusCode.FAILED_PRECONDITION
                    else grpc.StatusCode.FAILED_PRECONDITION,
                    f"handshake with prefill {request.prefill_address} failed: {e.details()}",
                ) from e
            node.lease_keeper.ensure_started()
            kv_params = RemotePrefillParams(request.transfer_id, request.prefill_address)
            if request.first_token_from_prefill:
                node.early_ids.add(request.request_id)
        embeds = None
        if request.HasField("prompt_embeds"):
            try:
                embeds = convert.tensor_from_pb(request.prompt_embeds)
            except PdserveError as e:
                raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"prompt_embeds: {e}") from e
        mm_items: list[Any] = []
        if request.mm_items:
            try:
                wire = items_from_pb(request.mm_items, node.opts.mm_policy, node.opts.name)
                if not request.remote_prefill and any(it.embeds is None for it in wire):
                    raise PdserveError(
                        "decode prefills this prompt itself (no remote prefill), but its image items "
                        "carry no embeddings; send them to a prefill node (EC consumer) instead"
                    )
            except PdserveError as e:
                raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
            mm_items = to_engine_items(wire, [it.embeds for it in wire])
            if any(it.embeds is None for it in wire):
                node.no_recompute_ids.add(request.request_id)
        return _Admission(
            list(request.prompt_token_ids),
            params,
            request.request_id,
            dict(
                kv_transfer_params=kv_params,
                output_token_ids=list(request.output_token_ids) or None,
                prompt_embeds=embeds,
                mm_items=mm_items,
            ),
        )

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext) -> Any:
        node = self.node
        try:
            adm = await self._open(request)
        except _Refusal as r:
            node.forget_flags(request.request_id)
            await context.abort(r.code, r.details)
        except BaseException:
            node.forget_flags(request.request_id)
            raise
        assert node.engine_loop is not None
        gen = node.engine_loop.generate(adm.prompt_token_ids, adm.params, adm.request_id, **adm.kwargs)
        try:
            async for d in gen:
                if d.finish_reason == "error" and d.overloaded:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, d.error or "node is full")
                if d.finish_reason == "error" and request.request_id in node.reprefill_ids:
                    node.reprefill_ids.discard(request.request_id)
                    context.set_trailing_metadata(((KV_LOAD_FAILED_KEY, "1"),))
                    await context.abort(
                        grpc.StatusCode.ABORTED, f"{d.error} (kv_load_failure_policy reprefill)"
                    )
                yield convert.delta_to_pb(d)
        except PdserveError as e:
            await context.abort(channel.error_to_status(e), str(e))
        finally:
            node.forget_flags(request.request_id)
            await gen.aclose()

    async def steps_session(
        self, request_iterator: AsyncIterator[pb.StepCommand], direct: DirectSteps
    ) -> AsyncIterator[pb.StepBatch]:
        """One Steps stream: one router connection to the Steps socket (services/steps_socket.py),
        every decode leg the router has on this node.

        The engine thread writes the requests' token deltas to the connection itself
        (``direct``, services/steps_direct.py). Each request runs as a task whose ends, refusals
        and error deltas go into the outbox; this yields the outbox as one batch whenever the
        previous write is done. The stream ending (the router went away) cancels every request's
        task, which aborts it on the engine."""
        outbox = Outbox()
        tasks: dict[str, asyncio.Task[None]] = {}

        def admit(r: pb.DecodeRequest) -> None:
            rid = r.request_id
            gate = self.node.drain_gate
            if gate is not None and gate.draining:
                outbox.end(rid, grpc.StatusCode.UNAVAILABLE, "node is draining: Decode refused, use another")
                return
            if not rid or rid in tasks:
                outbox.end(rid, grpc.StatusCode.INVALID_ARGUMENT, f"request id {rid!r} is empty or in use")
                return
            task = asyncio.get_running_loop().create_task(
                self._step_request(r, outbox, direct), name=f"step-{rid}"
            )
            tasks[rid] = task

            def done(_t: asyncio.Task[None], rid: str = rid) -> None:
                tasks.pop(rid, None)
                outbox.wake()

            task.add_done_callback(done)

        async def read() -> None:
            async for cmd in request_iterator:
                for r in cmd.start:
                    admit(r)
                for rid in cmd.abort:
                    t = tasks.get(rid)
                    if t is not None:
                        t.cancel()

        reader = asyncio.get_running_loop().create_task(read(), name="steps-reader")
        try:
            while True:
                batch = await outbox.take(reader, lambda: reader.done() and not tasks)
                if batch is None:
                    break
                yield batch
        finally:
            reader.cancel()
            pending = list(tasks.values())
            for t in pending:
                t.cancel()
            await asyncio.gather(reader, *pending, return_exceptions=True)

    async def _step_request(self, request: pb.DecodeRequest, outbox: Outbox, direct: DirectSteps) -> None:
        """One request of a Steps stream: admit it; the engine thread writes its token deltas
        (``direct``) and hands the rest to the outbox (a callback per step, no task wake-up per
        step); this task only waits for the end. Cancelling it (router abort, stream gone)
        aborts the request."""
        node = self.node
        rid = request.request_id
        gate = node.drain_gate
        if gate is not None:
            gate.active += 1
        try:
            try:
                adm = await self._open(request)
            except _Refusal as r:
                outbox.end(rid, r.code, r.details)
                return
            loop = node.engine_loop
            assert loop is not None
            ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            interval = request.flush_interval_ms / 1000.0
            if interval > 0:
                direct.hold(rid, interval)  # merged on the engine thread, as Outbox would

            def on_delta(d: GenerationDelta) -> None:
                if ended.done():
                    return
                if direct.takes(d):
                    # the engine thread wrote it; only its end is this callback's (finishing deltas)
                    if d.finish_reason is not None:
                        ended.set_result(None)
                    return
                if d.finish_reason == "error" and d.overloaded:
                    outbox.end(rid, grpc.StatusCode.RESOURCE_EXHAUSTED, d.error or "node is full")
                elif d.finish_reason == "error" and rid in node.reprefill_ids:
                    node.reprefill_ids.discard(rid)
                    outbox.end(
                        rid,
                        grpc.StatusCode.ABORTED,
                        f"{d.error} (kv_load_failure_policy reprefill)",
                        kv_load_failed=True,
                    )
                else:
                    outbox.put(d, interval)
                    if d.finish_reason is None:
                        return
                ended.set_result(None)

            try:
                await loop.admit(adm.prompt_token_ids, adm.params, rid, on_delta, direct=direct, **adm.kwargs)
            except PdserveError as e:
                outbox.end(rid, channel.error_to_status(e), str(e))
                return
            finished = False
            try:
                await ended
                finished = True
            finally:
                loop.release(rid, abort=not finished)
                if not finished:
                    outbox.drop(rid)
        finally:
            # every exit drops the request's marks: a refusal, a failed admit, the end, and a
            # cancellation while admitting (the router aborted or its stream went away)
            node.forget_flags(rid)
            direct.forget(rid)
            if gate is not None:
                gate.active -= 1

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        assert self.node.engine_loop is not None
        ids = list(request.request_ids)
        aborted = await self.node.engine_loop.call(lambda e: e.abort(ids))
        return pb.AbortResponse(num_aborted=len(aborted))

    async def GetLoad(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadReport:
        return await self.node.answer_load(pb, context)


class _Refusal(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


@dataclasses.dataclass
class _Admission:
    """What ``LLMEngine.add_request`` gets for a checked DecodeRequest."""

    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str
    kwargs: dict[str, Any]
