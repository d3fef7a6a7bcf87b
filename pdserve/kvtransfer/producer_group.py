"""A prefill node's producers, one per pipeline stage, answering decode's pulls.

    pull (PullRequest) -> checked: epoch, layout (compat hash)       -> STALE
                       -> wait until the transfer's KV is held here    -> NOT_FOUND / NOT_READY
                          (an early pull on the loop, others in a thread)
                       -> stages and TP ranks to ask for the asking decode stage and rank
                          (topology.prefill_stages_to_ask, prefill_ranks_to_ask), need_send raised
                          to what its PP and TP sizes imply
                       -> every asked stage's KVProducer.push, in parallel -> PushOutcome

A refused pull raises ``PullRefusedError`` naming why (``PullRefusal``); the service maps each
reason to its gRPC status. No gRPC here.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.errors import ConfigError, InvalidRequestError, PdserveError
from pdserve.kvtransfer.connector import KVProducer, PushResult
from pdserve.kvtransfer.handshake import HandshakeInfo
from pdserve.kvtransfer.peer import PullRequest
from pdserve.kvtransfer.regions import BlockIdError, RegionMismatchError
from pdserve.kvtransfer.send_tracker import UnknownTransferError
from pdserve.kvtransfer.topology import (
    check_tp_pair,
    kv_head_range,
    need_send,
    prefill_ranks_to_ask,
    prefill_stages_to_ask,
)

logger = logging.getLogger(__name__)


class PullRefusal(enum.Enum):
    STALE = "stale"  # prefill restarted (epoch) or the layouts differ: handshake anew
    NOT_FOUND = "not_found"  # no such transfer here, or its prefill ended without holding its KV
    NOT_READY = "not_ready"  # its KV was not held within kv_ready_timeout_s
    INVALID = "invalid"  # the pull itself is wrong (stage, blocks, regions)
    UNSUPPORTED = "unsupported"  # asks what this node does not do (a checksum with pp > 1)


class PullRefusedError(PdserveError):
    def __init__(self, refusal: PullRefusal, message: str) -> None:
        super().__init__(message)
        self.refusal = refusal


@dataclass(frozen=True)
class PushOutcome:
    """One pull served: the asked stages' pushes (in ``stages`` order), and what the reply carries."""

    transfer_id: str
    stages: list[int]  # the prefill stages asked
    results: list[PushResult]
    checksum: str  # hex digest of the pushed blocks ("" unless asked)
    first_token_ids: list[int]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)


class KVProducerGroup:
    def __init__(
        self,
        producers: Sequence[KVProducer],
        handshake: HandshakeInfo,
        ready_timeout_s: float,
        digest: Callable[[Sequence[int]], str],
        push_delay_s: float = 0.0,
        ranks: Sequence[tuple[int, int]] = (),
    ) -> None:
        """``producers``: stage 0's (TP rank 0's) first, sharing one tracker; ``ranks``: each
        one's (pp rank, tp rank) (default: stage i, TP rank 0). ``digest``: hex digest of KV
        blocks (a checksum asked for). ``push_delay_s``: test-only fault (a long transfer window)."""
        self.producers = list(producers)
        self.ranks = list(ranks) or [(i, 0) for i in range(len(self.producers))]
        assert len(self.ranks) == len(self.producers), (self.ranks, len(self.producers))
        self.p_pp = 1 + max(pp for pp, _ in self.ranks)
        self.p_tp = 1 + max(tp for _, tp in self.ranks)
        self.tracker = self.producers[0].tracker
        self.handshake = handshake
        self.ready_timeout_s = ready_timeout_s
        self._digest = digest
        self.push_delay_s = push_delay_s
        self.pushes_in_flight = 0  # pulls being pushed (LoadReport.num_pushes_in_flight)

    async def serve(self, req: PullRequest) -> PushOutcome:
        """Wait for the transfer's KV, then push it into the asking decode stage."""
        await self._wait_for_kv(req)
        # Counted once the KV is held: an early pull waiting for its prefill moves nothing yet.
        self.pushes_in_flight += 1
        try:
            return await self._push(req)
        finally:
            self.pushes_in_flight -= 1

    async def _wait_for_kv(self, req: PullRequest) -> None:
        tid, h = req.transfer_id, self.handshake
        if req.expected_src_epoch and req.expected_src_epoch != h.epoch:
            raise PullRefusedError(
                PullRefusal.STALE,
                f"prefill restarted: epoch is {h.epoch}, decode expected {req.expected_src_epoch}",
            )
        if req.dst_compat_hash != h.compat_hash:
            raise PullRefusedError(
                PullRefusal.STALE,
                "KV layout mismatch (compat hash differs): run Handshake to see which field",
            )
        producer = self.producers[0]
        try:
            if req.early:
                # Opened with the prefill leg: its Prefill may not even be admitted yet. Waits on
                # the loop (no executor thread: hundreds of early pulls may wait at once).
                ready = await producer.wait_held(tid, self.ready_timeout_s)
            else:
                # Held already (the router opens the decode leg after the first token): no thread hop.
                ready = producer.is_ready(tid) or await asyncio.to_thread(
                    producer.wait_ready, tid, self.ready_timeout_s
                )
        except KeyError:
            raise PullRefusedError(PullRefusal.NOT_FOUND, f"unknown transfer_id {tid!r}") from None
        except UnknownTransferError as e:
            raise PullRefusedError(
                PullRefusal.NOT_FOUND, f"the prefill of transfer {tid!r} ended without holding its KV"
            ) from e
        if not ready:
            raise PullRefusedError(PullRefusal.NOT_READY, f"KV for {tid!r} not ready in time")

    def _check_dst(self, req: PullRequest, d_pp: int, d_tp: int) -> tuple[int, int] | None:
        """The asking decode stage and rank within its node's sizes; returns the KV heads it holds
        (None when the TP sizes are equal: the asked rank holds the same ones)."""
        if not 0 <= req.dst_pp_rank < d_pp:
            raise PullRefusedError(
                PullRefusal.INVALID,
                f"dst_pp_rank {req.dst_pp_rank} is outside the decode node's {d_pp} stages",
            )
        heads = self.handshake.num_kv_heads
        if not 0 <= req.dst_tp_rank < d_tp or heads % d_tp:
            raise PullRefusedError(
                PullRefusal.INVALID,
                f"dst_tp_rank {req.dst_tp_rank} of dst_tp_size {d_tp}: a rank in [0, tp) of a TP "
                f"size that divides the model's {heads} KV heads",
            )
        try:
            check_tp_pair(self.p_tp, d_tp)
        except ConfigError as e:
            raise PullRefusedError(PullRefusal.INVALID, str(e)) from e
        if d_tp == self.p_tp:
            return None  # rank r pairs with rank r: the same heads, whole blocks
        return kv_head_range(req.dst_tp_rank, d_tp, heads)

    def _block_digest(self, transfer_id: str, num_tokens: int) -> str:
        """Digest of the held blocks a push of ``num_tokens`` sends (taken before the push: after
        it the blocks may be freed and reused)."""
        entry = self.tracker.get(transfer_id)
        if entry is None:
            return ""  # the push below answers NOT_FOUND
        n = -(-num_tokens // self.producers[0].block_size)
        return self._digest(entry.block_ids[:n])

    async def _push(self, req: PullRequest) -> PushOutcome:
        """The transfer's KV is held: write it into the asking decode stage's blocks."""
        tid = req.transfer_id
        # Read before the push: the last pull frees the transfer, and its tokens with it.
        first_token_ids = self.producers[0].first_token_ids(tid)
        if self.push_delay_s:
            await asyncio.sleep(self.push_delay_s)
        d_pp, d_tp = req.dst_pp_size or 1, req.dst_tp_size or 1
        p_pp, p_tp = self.p_pp, self.p_tp
        dst_heads = self._check_dst(req, d_pp, d_tp)
        digest = ""
        if req.want_checksum:
            if len(self.producers) > 1:
                raise PullRefusedError(
                    PullRefusal.UNSUPPORTED,
                    f"kv_checksum is not supported from a prefill node with pp={p_pp}, tp={p_tp}",
                )
            digest = await asyncio.to_thread(self._block_digest, tid, req.num_tokens)
        # The asking decode stage's consumers: every stage of ours counts it (sizes differ) or
        # only the same index (equal sizes). A router that told us fewer pulls than this decode
        # node's stages make is corrected here, before any of them is counted.
        self.tracker.require(tid, need_send(p_tp, p_pp, d_tp, d_pp))
        ask_pp = prefill_stages_to_ask(req.dst_pp_rank, p_pp, d_pp)
        ask_tp = prefill_ranks_to_ask(req.dst_tp_rank, p_tp, d_tp)
        ask = [i for i, (pp, tp) in enumerate(self.ranks) if pp in ask_pp and tp in ask_tp]
        consumer = (req.dst_pp_rank, req.dst_tp_rank)  # a retried pull counts once
        results = await asyncio.gather(
            *(
                asyncio.to_thread(
                    self.producers[i].push,
                    tid,
                    list(req.dst_block_ids),
                    req.num_tokens,
                    req.dst_regions,
                    req.dst_session,
                    consumer,
                    dst_heads,
                    req.dst_group_block_ids,
                )
                for i in ask
            ),
            return_exceptions=True,
        )
        res: list[PushResult] = []
        for r in results:
            if isinstance(r, UnknownTransferError):
                raise PullRefusedError(PullRefusal.NOT_FOUND, str(r)) from r
            if isinstance(r, (RegionMismatchError, BlockIdError, InvalidRequestError, ValueError)):
                raise PullRefusedError(PullRefusal.INVALID, str(r)) from r
            if isinstance(r, BaseException):
                raise r
            res.append(r)
        out = PushOutcome(tid, list(ask), res, digest, first_token_ids)
        if not out.ok:
            logger.warning("push %s failed: %s", tid, "; ".join(r.error for r in res if not r.ok))
        return out
