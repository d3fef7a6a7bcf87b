"""The engine's side of KV transfer: what a prefill node holds and pushes, what a decode node
announces. Services translate gRPC to these calls; no gRPC here.

    prefill (producer)                                  decode (consumer)
    ------------------                                  -----------------
    request finishes -> on_hold(): blocks held          allocates blocks (WAITING_FOR_REMOTE_KV)
      under a lease (KVSendTracker)              <----  PushKV(transfer_id, block ids, regions, session)
    push(): align regions by name, merge blocks,
      one batched write into decode's blocks     ---->  bytes land in its KV tensor
    end_send(): count the pull; free at need_send       finish_kv_load(ok) -> RUNNING

An early pull (decode opened with the prefill leg) may come before its prefill is admitted:
``wait_held`` waits for the hold on the event loop (no thread), and fails as soon as the prefill
ends without holding (``forget`` / ``refuse``); the ids and their waiters are kept in a
``TransferTable`` (kvtransfer/transfer_table.py). Every push answers with the first tokens that
``on_hold`` stored (``first_token_ids``) and moves the other KV groups' held tables it stored,
both dropped with the transfer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.errors import InvalidRequestError
from pdserve.kvtransfer.backend import TransferBackend
from pdserve.kvtransfer.descriptors import Spans
from pdserve.kvtransfer.group_transfer import GroupPlan, GroupPlans
from pdserve.kvtransfer.head_slices import GatherPlan, GatherWriter, HeadLayout, HeadSlicePlan
from pdserve.kvtransfer.producer_transfer import ProducerTransfer
from pdserve.kvtransfer.regions import DescriptorPlan, Region, align_regions, layout_key
from pdserve.kvtransfer.send_tracker import KVSendTracker, UnknownTransferError
from pdserve.kvtransfer.transfer_table import TransferTable

logger = logging.getLogger(__name__)


@dataclass
class PushResult:
    ok: bool
    bytes: int
    num_descriptors: int
    seconds: float
    error: str = ""


class KVProducer:
    """Prefill side. Thread-safe: ``on_hold`` runs on the engine thread, ``push`` on gRPC workers."""

    def __init__(
        self,
        backend: TransferBackend,
        regions: Sequence[Region],
        block_size: int,
        release: Callable[[str], None],
        lease_s: float = 30.0,
        *,
        stage: int = 0,
        num_stages: int = 1,
        tracker: KVSendTracker | None = None,
        heads: tuple[int, int] | None = None,
        layout: HeadLayout | None = None,
        gatherer: GatherWriter | None = None,
        layer_groups: Sequence[set[str]] = (),
    ) -> None:
        """One producer per prefill stage and TP rank: ``regions`` are its layers, ``heads``
        the ``[start, end)`` KV heads it holds (of the model's; ``layout`` says a block's row
        geometry): a puller holding other heads gets head slices (``head_slices``). The
        producers of a node share one ``tracker`` (one block table per node), which frees a
        request once every one of the ``num_stages`` producers counted its consumers.
        ``layer_groups``: the layer names of each KV group when the groups have block tables of
        their own (kvtransfer/group_transfer.py); () for one table."""
        self.backend = backend
        self.regions = list(regions)
        self.block_size = block_size
        self._release = release  # frees the request's blocks (posted to the engine thread)
        self._lock = threading.Lock()  # guards the plan cache
        self.stage = stage
        self.num_stages = num_stages
        self.tracker = tracker if tracker is not None else KVSendTracker(self._free_transfer, lease_s)
        self._table = TransferTable(self.tracker)  # admitted / held / early-awaited / ended ids
        # receiver regions -> aligned + fused plan: a decode's layout is the same on every push,
        # and aligning 16 layers cost more host time than a 2k-token prompt's device copy
        self._plans: dict[
            tuple[tuple[Any, ...], tuple[int, int] | None], DescriptorPlan | HeadSlicePlan | GatherPlan
        ] = {}
        self.heads = heads
        self.layout = layout
        self.gatherer = gatherer  # packs a puller's heads next to the KV tensor (GatherPlan)
        self.layer_groups = list(layer_groups)
        self._group_plans = GroupPlans(self.regions, self.layer_groups)
        # Counters for metrics.
        self.bytes_total = 0
        self.seconds_total = 0.0
        self.failures_total = 0
        self.pushes_total = 0
        self.aborted_total = 0

    def admit(self, transfer_id: str) -> None:
        """A prefill for ``transfer_id`` was admitted: a push may wait for it. Refuses a
        transfer_id already admitted or held: a second request with it would collide with the
        first one's hold (refused here, before the engine thread, where a refused hold would fail
        every request on the node). Early pulls waiting for a
        transfer_id no prefill admitted yet (``wait_held``) do not make it a duplicate."""
        self._table.admit(transfer_id)

    def track(self, transfer_id: str) -> ProducerTransfer:
        """One Prefill call's handle on ``transfer_id`` (admit, then one end state)."""
        return ProducerTransfer(self, transfer_id)

    def refuse(self, transfer_id: str) -> None:
        """A prefill for ``transfer_id`` was refused before its admission (or its RPC ended):
        early pulls waiting for it fail now, and so does one that comes later (an admitted
        transfer, another request's, is left alone)."""
        self._table.refuse(transfer_id)

    def forget(self, transfer_id: str) -> None:
        """Drop the transfer's state (freed, failed, aborted); early pulls still waiting for its
        hold fail now, and so does one that comes later."""
        self._table.forget(transfer_id)

    @property
    def num_transfers(self) -> int:
        """Transfers admitted, held or awaited by an early pull now (0 once none is in flight;
        the bounded record of ended ids is not counted)."""
        return len(self._table)

    def ended(self, transfer_id: str) -> bool:
        """Whether ``transfer_id`` ended here (among the last ENDED_KEEP that did)."""
        return self._table.ended(transfer_id)

    def on_hold(
        self,
        transfer_id: str,
        block_ids: list[int],
        need_send: int,
        first_token_ids: Sequence[int] = (),
        group_block_ids: Sequence[Sequence[int]] = (),
    ) -> None:
        """Engine thread: the request's KV is complete; hold its blocks under a lease.
        ``first_token_ids``: the request's tokens now (what every push answers with);
        ``group_block_ids``: the held tables of the KV groups after the first."""
        self._table.hold(
            transfer_id,
            lambda: self.tracker.add(transfer_id, block_ids, need_send, self.num_stages),
            first_token_ids,
            group_block_ids,
        )

    def first_token_ids(self, transfer_id: str) -> list[int]:
        """The tokens the transfer's request had when its KV was held ([] if not held or freed)."""
        return self._table.first_token_ids(transfer_id)

    def _free_transfer(self, transfer_id: str, _block_ids: Sequence[int]) -> None:
        self.forget(transfer_id)
        self._release(transfer_id)

    def _expected(self, transfer_id: str) -> threading.Event:
        return self._table.expected(transfer_id)

    def is_ready(self, transfer_id: str) -> bool:
        """Whether the transfer's KV is held now (no wait); KeyError if never expected."""
        return self._expected(transfer_id).is_set()

    def wait_ready(self, transfer_id: str, timeout_s: float) -> bool:
        """Block until the transfer's KV is held. False on timeout; KeyError if never expected."""
        return self._expected(transfer_id).wait(timeout_s)

    async def wait_held(self, transfer_id: str, timeout_s: float) -> bool:
        """An early pull: wait on the running loop, holding no thread, until the transfer's KV is
        held (``TransferTable.wait_held``: True held, False timed out, UnknownTransferError when
        its prefill ended without holding or was not admitted within ADMIT_GRACE_S)."""
        return await self._table.wait_held(transfer_id, timeout_s)

    def push(
        self,
        transfer_id: str,
        dst_block_ids: Sequence[int],
        num_tokens: int,
        dst_regions: Sequence[Region],
        dst_session: str,
        consumer: tuple[int, int] | None = None,
        dst_heads: tuple[int, int] | None = None,
        dst_group_block_ids: Sequence[Sequence[int]] = (),
    ) -> PushResult:
        """Write the held KV into the puller's blocks. Validation errors raise before anything is
        written (InvalidRequestError, RegionMismatchError, BlockIdError, UnknownTransferError);
        a failed write returns ok=False and counts as a report (docs/design.md §3). ``consumer`` is the
        asking (decode pp_rank, tp_rank): counted once however often it asks. A puller that
        shares no layer with this stage moves no bytes and still counts. ``dst_heads``: the KV
        heads the puller holds (None: the same as this producer's, as between equal TP sizes).
        ``dst_group_block_ids``: the puller's tables of the KV groups after the first, when the
        groups have tables of their own (each group's blocks move with its own ids)."""
        held_ids = self.tracker.held_ids(transfer_id)
        if held_ids is None:
            raise UnknownTransferError(transfer_id)
        need_blocks = -(-num_tokens // self.block_size)
        if num_tokens < 1 or need_blocks > len(held_ids):
            raise InvalidRequestError(
                f"num_tokens {num_tokens} does not fit the {len(held_ids)} blocks held for {transfer_id}"
            )
        if len(dst_block_ids) != need_blocks:
            raise InvalidRequestError(
                f"{len(dst_block_ids)} destination blocks for {num_tokens} tokens; expected {need_blocks}"
            )
        src_ids = held_ids.head(need_blocks)
        plan: DescriptorPlan | HeadSlicePlan | GatherPlan | GroupPlan
        spans: Spans | None = None  # known to a DescriptorPlan: the backend checks them, not every row
        if self.layer_groups:
            if dst_heads is not None and dst_heads != self.heads:
                raise InvalidRequestError(
                    "KV groups with tables of their own move between equal TP sizes only"
                )
            plan = self._group_plans.get(dst_regions)
            held = self._table.group_block_ids(transfer_id)
            descs = plan.descriptors(src_ids, dst_block_ids, held, dst_group_block_ids)
        else:
            plan = self._plan(dst_regions, dst_heads)
            if isinstance(plan, DescriptorPlan):
                descs, spans = plan.descriptors_spans(src_ids, dst_block_ids)
            else:
                descs = plan.descriptors(src_ids, dst_block_ids)
        # a DescriptorPlan's rows move every block pair once in every layer; others: sum the table
        if isinstance(plan, DescriptorPlan):
            nbytes = need_blocks * plan.bytes_per_block
        else:
            nbytes = int(descs[:, 2].sum())
        t0 = time.perf_counter()
        ok, err = False, ""
        self.tracker.start_send(transfer_id)
        try:
            if len(descs) and isinstance(plan, GatherPlan):
                assert self.gatherer is not None
                self.gatherer.write_gathered(
                    dst_session, plan.gather(src_ids.tolist()), descs, transfer_id=transfer_id
                )
            elif len(descs):
                self.backend.write_spanned(dst_session, descs, spans, transfer_id=transfer_id)
            ok = True
        except Exception as e:  # the write failed: counted and reported, never swallowed silently
            err = str(e)
            logger.warning("KV push %s -> %s failed: %s", transfer_id, dst_session, e)
        finally:
            dt = time.perf_counter() - t0
            self.tracker.end_send(transfer_id, ok, consumer, self.stage)
        self.pushes_total += 1
        if ok:
            self.bytes_total += nbytes
            self.seconds_total += dt
        else:
            self.failures_total += 1
        return PushResult(ok, nbytes if ok else 0, len(descs), dt, err)

    def _plan(
        self, dst_regions: Sequence[Region], dst_heads: tuple[int, int] | None
    ) -> DescriptorPlan | HeadSlicePlan | GatherPlan:
        key = (layout_key(dst_regions), dst_heads)
        with self._lock:
            plan = self._plans.get(key)
        if plan is None:  # RegionMismatchError: not cached
            if dst_heads is None or dst_heads == self.heads:
                plan = DescriptorPlan(align_regions(self.regions, dst_regions))
            else:
                if self.layout is None or self.heads is None:
                    raise InvalidRequestError(
                        f"the puller holds KV heads {dst_heads}, this producer {self.heads}; "
                        "it has no head layout to slice them"
                    )
                pairs = align_regions(self.regions, dst_regions, same_size=False)
                if (
                    self.gatherer is not None
                    and self.heads[0] <= dst_heads[0]
                    and dst_heads[1] <= self.heads[1]
                ):
                    plan = GatherPlan(pairs, self.regions, self.heads, dst_heads, self.layout)
                else:
                    plan = HeadSlicePlan(pairs, self.heads, dst_heads, self.layout)
            with self._lock:
                if len(self._plans) >= 64:  # decode layouts seen; bounded against a churning fleet
                    self._plans.clear()
                self._plans[key] = plan
        return plan

    def keep_alive(self, transfer_ids: Sequence[str]) -> list[str]:
        """A consumer still wants these: extend their leases; returns the ids not held here."""
        unknown = []
        for tid in transfer_ids:
            try:
                self.tracker.heartbeat(tid)
            except UnknownTransferError:
                unknown.append(tid)
        return unknown

    def abort(self, transfer_id: str) -> bool:
        if transfer_id in self.tracker:
            self.aborted_total += 1  # a hold given up before its pull (client gone, decode failed)
        freed = self.tracker.abort(transfer_id)
        if transfer_id not in self.tracker:
            self.forget(transfer_id)
        return freed
