"""The decode side of KV transfer: the consumer beside ``KVProducer`` (connector.py).

    decode (KVConsumer)                                  prefill (KVProducer)
    -------------------                                  --------------------
    open(): handshake (cached per address and epoch),
      one PullRecord per request (WAITING)
    LeaseKeeper: KeepAlive for WAITING records   ---->   keep_alive(): leases extended
    the engine allocated blocks -> start_pull()
      one PullRequest per decode stage (PULLING) ---->   push(): one batched write per stage
    checksum verified -> READY | FAILED          <----   reply: ok, bytes, digest, first token
    on_loaded(request, ok, policy, ...) -> engine.finish_kv_load
    forget(): the decode leg ended, record dropped

Calls to prefill go through a ``PrefillPeer`` (peer.py): no gRPC here. Event loop only, except
the checksum's digest, which runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from pdserve.config.choices import KvLoadFailurePolicy
from pdserve.errors import PdserveError
from pdserve.kvtransfer.handshake import HandshakeError, HandshakeInfo, check_compat
from pdserve.kvtransfer.keepalive import LeaseKeeper
from pdserve.kvtransfer.load_policy import engine_policy
from pdserve.kvtransfer.params import KVLoadSpec
from pdserve.kvtransfer.peer import PeerCallError, PrefillPeer, PullReply, PullRequest
from pdserve.kvtransfer.pull_record import PullRecord, PullTable, TransferState
from pdserve.kvtransfer.regions import Region

logger = logging.getLogger(__name__)


class PullStage(Protocol):
    """One decode stage's (TP rank's) transfer endpoint (``pdserve.distributed.pp_stage.StageEndpoint``)."""

    @property
    def pp_rank(self) -> int: ...
    @property
    def tp_rank(self) -> int: ...
    @property
    def tp_size(self) -> int: ...
    @property
    def pp_size(self) -> int: ...
    @property
    def layer_start(self) -> int: ...
    @property
    def layer_end(self) -> int: ...
    @property
    def session(self) -> str: ...
    @property
    def regions(self) -> tuple[Region, ...]: ...


# request_id, ok, engine policy (fail | recompute), error, first tokens (early legs)
OnLoaded = Callable[[str, bool, KvLoadFailurePolicy, str, Sequence[int]], None]


class PullFailedError(PdserveError):
    """Prefill answered a stage's pull with the transfer failed, or without what was asked."""


class KVConsumer:
    def __init__(
        self,
        peers: PrefillPeer,
        handshake: HandshakeInfo,
        stages: Sequence[PullStage],
        block_size: int,
        on_loaded: OnLoaded,
        *,
        policy: KvLoadFailurePolicy = KvLoadFailurePolicy.RECOMPUTE,
        pull_timeout_s: float = 60.0,
        keepalive_s: float = 5.0,
        checksum: Callable[[Sequence[int]], str] | None = None,
        on_pull_seconds: Callable[[float], None] | None = None,
    ) -> None:
        """``on_loaded`` hands a pull's outcome to the engine (finish_kv_load). ``checksum``:
        the local digest of blocks (kv_checksum on; None: off). ``on_pull_seconds``: a
        successful pull's duration from its hand-over (the kv_pull_seconds histogram)."""
        self.peers = peers
        self.handshake = handshake
        self.stages = list(stages)
        self.block_size = block_size
        self._on_loaded = on_loaded
        self.policy = policy
        self.pull_timeout_s = pull_timeout_s
        self._checksum = checksum
        self._on_pull_seconds = on_pull_seconds
        self.records = PullTable()
        self._peers: dict[str, HandshakeInfo] = {}  # prefill address -> its handshake (epoch)
        self._pulls: set[asyncio.Task[None]] = set()
        self.keeper = LeaseKeeper(peers, self.records, keepalive_s, self.note_epoch)
        # Counters for metrics.
        self.pull_bytes_total = 0
        self.pull_seconds_total = 0.0
        self.pull_failures_total = 0
        self.early_pulls_total = 0
        self.checksums_verified_total = 0
        self.checksum_mismatches_total = 0
        self.stage_pull_bytes = [0] * len(self.stages)  # per decode endpoint (metrics, GetLoad)
        self.stage_pull_failures = [0] * len(self.stages)
        self.stage_pulls = [0] * len(self.stages)

    # --- handshake ------------------------------------------------------------------------------

    async def peer(self, address: str) -> HandshakeInfo:
        """The prefill node's handshake, compared once per (address, epoch). Raises
        HandshakeError (incompatible KV) or PeerCallError (the call failed)."""
        known = self._peers.get(address)
        if known is not None:
            return known
        remote = await self.peers.handshake(address, self.handshake)
        check_compat(self.handshake, remote)
        self._peers[address] = remote
        return remote

    def forget_peer(self, address: str) -> None:
        self._peers.pop(address, None)

    def note_epoch(self, address: str, epoch: str) -> None:
        """The peer's epoch as another message told it: a new one (a restart) is handshaken anew."""
        known = self._peers.get(address)
        if known is not None and epoch and known.epoch != epoch:
            logger.warning("prefill %s restarted (epoch %s -> %s): re-handshake", address, known.epoch, epoch)
            self.forget_peer(address)

    # --- records --------------------------------------------------------------------------------

    async def open(
        self,
        request_id: str,
        transfer_id: str,
        prefill_address: str,
        *,
        prefill_epoch: str = "",
        early: bool = False,
        no_recompute: bool = False,
    ) -> PullRecord:
        """Decode admits a remote-prefill request: handshake with its prefill node, then its
        record (WAITING). Raises as ``peer``; nothing is recorded then."""
        self.note_epoch(prefill_address, prefill_epoch)
        await self.peer(prefill_address)
        rec = self.records.add(PullRecord(request_id, transfer_id, prefill_address, early, no_recompute))
        self.keeper.ensure_started()
        return rec

    def forget(self, request_id: str) -> None:
        """The request's decode leg ended (any way): drop its record."""
        self.records.pop(request_id)

    def wants_reprefill(self, request_id: str) -> bool:
        """Whether the request's failed pull is the router's to re-drive (reprefill policy, or
        an early leg, whose first token only the router has)."""
        rec = self.records.get(request_id)
        return rec is not None and rec.reprefill

    def request_state_sizes(self) -> dict[str, int]:
        return {"kv_consumer.transfers": len(self.records), "kv_consumer.pulls": len(self._pulls)}

    def pulls_in_flight(self) -> int:
        """Transfers being pulled now (PushKV calls out): LoadReport.num_pulls_in_flight."""
        return sum(1 for r in self.records if r.state is TransferState.PULLING)

    # --- the pull -------------------------------------------------------------------------------

    def start_pull(self, spec: KVLoadSpec, t_handed: float | None = None) -> None:
        """Event loop: the engine allocated the request's blocks; pull its KV into them."""
        task = asyncio.get_running_loop().create_task(self.pull(spec, t_handed))
        self._pulls.add(task)
        task.add_done_callback(self._pulls.discard)

    async def pull(self, spec: KVLoadSpec, t_handed: float | None = None) -> None:
        p = spec.params
        rec = self.records.get(spec.request_id)
        if rec is None or rec.transfer_id != p.transfer_id:
            # its leg ended as the engine handed the pull over: pull anyway, prefill frees sooner
            rec = PullRecord(spec.request_id, p.transfer_id, p.prefill_address)
        elif rec.state in (TransferState.READY, TransferState.FAILED):
            # pulled before and handed back to the queue (not expected): a pull anew
            logger.warning("KV pull %s asked again (was %s)", p.transfer_id, rec.state.name)
            rec.state, rec.reprefill, rec.checksum, rec.error = TransferState.WAITING, False, "", ""
        self.early_pulls_total += rec.early
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        t_start = time.monotonic() if t_handed is None else t_handed
        ok, err = False, ""
        first: tuple[int, ...] = ()
        try:
            if rec.state is TransferState.EXPIRED:
                raise PullFailedError(
                    f"prefill {p.prefill_address} no longer holds {p.transfer_id} (KeepAlive)"
                )
            rec.move(TransferState.PULLING)
            ok, err, first = await self._pull_stages(spec, rec)
        except PeerCallError as e:
            err = str(e)
            if e.stale_peer:
                self.forget_peer(p.prefill_address)  # re-handshake next time (restart / mismatch)
        except (HandshakeError, PdserveError) as e:
            err = str(e)
        except Exception as e:  # never leave the request waiting for KV: the policy applies
            logger.exception("KV pull %s: unexpected error", p.transfer_id)
            err = f"KV pull failed: {e!r}"
        self.pull_seconds_total += loop.time() - t0
        if ok and self._on_pull_seconds is not None:
            self._on_pull_seconds(time.monotonic() - t_start)
        self._end(rec, ok, err, first)

    async def _pull_stages(self, spec: KVLoadSpec, rec: PullRecord) -> tuple[bool, str, tuple[int, ...]]:
        """One PushKV per decode stage and TP rank, into its regions and session; the prefill
        node fans each out to its stages and ranks (kvtransfer.topology). The request runs only when every
        stage has its KV; all pulls end before the blocks can be reused."""
        addr = rec.prefill_address
        peer = await self.peer(addr)
        reqs = [self._pull_request(spec, rec, peer, st) for st in self.stages]
        results = await asyncio.gather(*(self._pull_stage(addr, r) for r in reqs), return_exceptions=True)
        errors: list[BaseException] = []
        first: tuple[int, ...] = ()
        for i, r in enumerate(results):
            self.stage_pulls[i] += 1
            if isinstance(r, BaseException):
                self.stage_pull_failures[i] += 1
                errors.append(r)
            else:
                self.stage_pull_bytes[i] += r.bytes
                first = first or r.first_token_ids
                rec.checksum = r.checksum or rec.checksum
        if errors:
            raise errors[0]
        if rec.early and not first:
            raise PullFailedError(f"prefill {addr} answered an early pull without the first token")
        rec.num_bytes = sum(r.bytes for r in results if isinstance(r, PullReply))
        self.pull_bytes_total += rec.num_bytes
        if self._checksum is None:
            return True, "", first
        # one endpoint (kv_checksum with pp > 1 or tp > 1 is refused at start)
        ok, err = await asyncio.to_thread(self._verify, reqs[0], rec.checksum)
        return ok, err, first

    def _pull_request(
        self, spec: KVLoadSpec, rec: PullRecord, peer: HandshakeInfo, st: PullStage
    ) -> PullRequest:
        return PullRequest(
            transfer_id=rec.transfer_id,
            dst_block_ids=tuple(spec.block_ids[: -(-spec.num_tokens // self.block_size)]),
            num_tokens=spec.num_tokens,
            dst_regions=tuple(st.regions),
            dst_session=st.session,
            dst_compat_hash=self.handshake.compat_hash,
            expected_src_epoch=peer.epoch,
            want_checksum=self._checksum is not None,
            dst_pp_rank=st.pp_rank,
            dst_tp_rank=st.tp_rank,
            dst_tp_size=st.tp_size,
            dst_pp_size=st.pp_size,
            dst_layer_start=st.layer_start,
            dst_layer_end=st.layer_end,
            early=rec.early,
            dst_group_block_ids=tuple(
                t[: -(-spec.num_tokens // self.block_size)] for t in spec.group_block_ids
            ),
        )

    async def _pull_stage(self, addr: str, req: PullRequest) -> PullReply:
        reply = await self.peers.push_kv(addr, req, self.pull_timeout_s)
        if not reply.ok:
            raise PullFailedError(
                f"prefill {addr} reported the write into decode stage {req.dst_pp_rank} as failed"
            )
        return reply

    def _verify(self, req: PullRequest, digest: str) -> tuple[bool, str]:
        """Worker thread: the received blocks against prefill's digest (kv_checksum)."""
        assert self._checksum is not None
        if not digest:
            return False, "prefill sent no checksum (kv_checksum is on here; is prefill older?)"
        if self._checksum(req.dst_block_ids) != digest:
            self.checksum_mismatches_total += 1
            return False, f"KV checksum mismatch for {req.transfer_id}: the transfer was corrupted"
        self.checksums_verified_total += 1
        return True, ""

    def _end(self, rec: PullRecord, ok: bool, err: str, first: Sequence[int]) -> None:
        """The failure policy, applied once per pull, and the outcome handed to the engine."""
        policy = engine_policy(self.policy)
        if rec.no_recompute or rec.early:
            policy = (
                KvLoadFailurePolicy.FAIL
            )  # images' embeddings not here / no first token here: cannot recompute
        if ok:
            rec.move(TransferState.READY)
        else:
            self.pull_failures_total += 1
            logger.warning("KV pull %s failed: %s (policy %s)", rec.transfer_id, err, self.policy)
            if rec.state is not TransferState.FAILED:
                rec.move(TransferState.FAILED)
            rec.error = err
            # read by the decode leg when its error delta comes
            rec.reprefill = self.policy is KvLoadFailurePolicy.REPREFILL or rec.early
        self._on_loaded(rec.request_id, ok, policy, err, first if rec.early else ())
