"""Prefill-side completion counting (docs/design.md §3): when may P free a request's KV blocks?

After prefill, P holds a request's blocks under a lease until every expected consumer has
reported. A consumer is one (D stage, D TP rank) pull, so a P stage expects
``need_send = (D TP ranks it serves) x (D PP size, when the PP sizes differ)`` reports. A pull
that failed still reports: that consumer is done with this P (it fails, recomputes or asks
another P), so holding the blocks for it would only strand them.

An entry is freed - ``free_fn(transfer_id, block_ids)`` called exactly once - on the first of:

    every stage counted need_send consumers and nothing in flight
    lease passed (expire())                 and nothing in flight
    abort()                                 and nothing in flight (else when the last write ends)

never while a write into the blocks' source memory is still in flight. Thread-safe.

Reports are counted per prefill stage (``num_stages``: the node's PP size; the blocks are one
node-wide table, so they are freed once, when every stage reached its count) and by consumer
identity ``(decode pp_rank, decode tp_rank)``: a retried or duplicated pull from the same consumer
counts once. A report without a consumer identity counts as a distinct one (single-stage peers).
"""

from __future__ import annotations

import copy
import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from pdserve.errors import PdserveError
from pdserve.kvtransfer.block_ids import BlockIds


class UnknownTransferError(PdserveError, LookupError):
    """No held KV for this transfer_id: never added, already freed, or aborted."""

    def __init__(self, transfer_id: str, reason: str = "unknown or already released") -> None:
        super().__init__(f"no KV held for transfer_id {transfer_id!r}: {reason}")
        self.transfer_id = transfer_id
        self.reason = reason


@dataclass
class SendEntry:
    """One request's held blocks; ``begin_send`` hands out copies, the tracker owns the original."""

    transfer_id: str
    block_ids: tuple[int, ...]
    need_send: int  # reports (completed pulls, ok or failed) expected before freeing
    deadline_s: float  # lease end on the tracker's clock
    sent: int = 0  # pulls that completed ok
    failed: int = 0  # pulls that completed with an error
    sending: int = 0  # writes in flight now
    aborted: bool = False  # free as soon as nothing is in flight
    num_stages: int = 1  # prefill stages that each must reach need_send
    # prefill stage -> the consumers that reported to it (distinct (pp_rank, tp_rank) pairs)
    consumers: dict[int, frozenset[object]] = field(default_factory=dict)
    # block_ids as int64 with their facts, made by the first push that asks (``held_ids``)
    ids: BlockIds | None = field(default=None, repr=False, compare=False)

    @property
    def reported(self) -> int:
        """Distinct reports, summed over the stages."""
        return sum(len(c) for c in self.consumers.values())

    @property
    def complete(self) -> bool:
        if self.num_stages == 1:  # one stage (the usual case): no generator
            return len(self.consumers.get(0, ())) >= self.need_send
        return all(len(self.consumers.get(s, ())) >= self.need_send for s in range(self.num_stages))


class KVSendTracker:
    """Holds prefill KV blocks per transfer_id until their consumers report, the lease ends, or abort."""

    def __init__(
        self,
        free_fn: Callable[[str, Sequence[int]], None],
        lease_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self._free_fn = free_fn
        self.lease_s = lease_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, SendEntry] = {}
        self._anon = itertools.count()

    # --- lifecycle ---------------------------------------------------------------------------

    def add(self, transfer_id: str, block_ids: Sequence[int], need_send: int, num_stages: int = 1) -> None:
        """Start holding ``block_ids`` (KV_READY); the lease starts now."""
        if num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {num_stages}")
        if need_send < 1:
            raise ValueError(f"need_send must be >= 1, got {need_send} for transfer_id {transfer_id!r}")
        with self._lock:
            if transfer_id in self._entries:
                raise ValueError(f"transfer_id {transfer_id!r} is already held")
            self._entries[transfer_id] = SendEntry(
                transfer_id, tuple(block_ids), need_send, self._clock() + self.lease_s, num_stages=num_stages
            )

    def begin_send(self, transfer_id: str) -> SendEntry:
        """A pull starts writing from this entry's blocks; extends the lease; returns a snapshot."""
        with self._lock:
            return copy.copy(self._begin(transfer_id))  # shallow, as dataclasses.replace, cheaper

    def start_send(self, transfer_id: str) -> None:
        """``begin_send`` without the snapshot (a push reads nothing of it)."""
        with self._lock:
            self._begin(transfer_id)

    def _begin(self, transfer_id: str) -> SendEntry:
        entry = self._entries.get(transfer_id)
        if entry is None:
            raise UnknownTransferError(transfer_id)
        if entry.aborted:
            raise UnknownTransferError(transfer_id, "aborted")
        entry.sending += 1
        self._extend(entry)
        return entry

    def end_send(
        self, transfer_id: str, ok: bool, consumer: tuple[int, int] | None = None, stage: int = 0
    ) -> bool:
        """A pull's write from prefill ``stage`` ended (ok or not): one report of ``consumer``
        (counted once however often it retries); True if this freed the entry."""
        with self._lock:
            entry = self._entries.get(transfer_id)
            if entry is None:
                raise UnknownTransferError(transfer_id)
            assert entry.sending > 0, f"end_send without begin_send for {transfer_id!r}"
            entry.sending -= 1
            assert 0 <= stage < entry.num_stages, f"stage {stage} of {entry.num_stages} for {transfer_id!r}"
            if ok:
                entry.sent += 1
            else:
                entry.failed += 1
            who: object = consumer if consumer is not None else ("anonymous", next(self._anon))
            entry.consumers[stage] = entry.consumers.get(stage, frozenset()) | {who}
            self._extend(entry)
            done = entry.sending == 0 and (entry.aborted or entry.complete)
            if done:
                del self._entries[transfer_id]
        if done:
            self._free_fn(entry.transfer_id, entry.block_ids)
        return done

    @contextmanager
    def sending(self, transfer_id: str) -> Iterator[SendEntry]:
        """``begin_send`` / ``end_send`` around a block; an exception counts as a failed pull."""
        entry = self.begin_send(transfer_id)
        ok = False
        try:
            yield entry
            ok = True
        finally:
            self.end_send(transfer_id, ok)

    def require(self, transfer_id: str, need_send: int) -> None:
        """Raise the entry's ``need_send`` to at least this (a consumer node with more stages than
        the count the entry was added with); unknown ids are left to the caller's push to report."""
        with self._lock:
            entry = self._entries.get(transfer_id)
            if entry is not None:
                entry.need_send = max(entry.need_send, need_send)

    def heartbeat(self, transfer_id: str) -> None:
        """The consumer is alive: extend the lease (raises UnknownTransferError if not held)."""
        with self._lock:
            entry = self._entries.get(transfer_id)
            if entry is None:
                raise UnknownTransferError(transfer_id)
            self._extend(entry)

    def abort(self, transfer_id: str) -> bool:
        """Release now if nothing is in flight (True), else when the last write ends (False).

        Unknown ids return False: cancels race with normal completion and must stay harmless.
        """
        with self._lock:
            entry = self._entries.get(transfer_id)
            if entry is None:
                return False
            entry.aborted = True
            if entry.sending > 0:
                return False
            del self._entries[transfer_id]
        self._free_fn(entry.transfer_id, entry.block_ids)
        return True

    def expire(self, now: float | None = None) -> list[str]:
        """Free entries whose lease has passed and that have nothing in flight; returns their ids."""
        now = self._clock() if now is None else now
        with self._lock:
            freed = [e for e in self._entries.values() if e.deadline_s <= now and e.sending == 0]
            for e in freed:
                del self._entries[e.transfer_id]
        for e in freed:
            self._free_fn(e.transfer_id, e.block_ids)
        return [e.transfer_id for e in freed]

    # --- queries (metrics) -------------------------------------------------------------------

    def __contains__(self, transfer_id: str) -> bool:
        with self._lock:
            return transfer_id in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def get(self, transfer_id: str) -> SendEntry | None:
        with self._lock:
            entry = self._entries.get(transfer_id)
            return None if entry is None else copy.copy(entry)

    def held_ids(self, transfer_id: str) -> BlockIds | None:
        """The entry's block ids as ``BlockIds`` (made by the first push, kept on the entry for
        the transfer's other pushes: TP ranks, stages), without a snapshot; None if not held."""
        with self._lock:
            entry = self._entries.get(transfer_id)
        if entry is None:
            return None
        ids = entry.ids
        if ids is None:  # two first pushes at once may both make them: the same value
            ids = entry.ids = BlockIds.of(entry.block_ids)
        return ids

    @property
    def num_held_blocks(self) -> int:
        with self._lock:
            return sum(len(e.block_ids) for e in self._entries.values())

    def stranded_blocks(self, now: float | None = None) -> int:
        """Blocks whose lease has passed with nothing in flight: no live peer will read them.

        They are what the next ``expire()`` frees; the ``stranded_kv_blocks`` metric.
        """
        now = self._clock() if now is None else now
        with self._lock:
            return sum(
                len(e.block_ids) for e in self._entries.values() if e.deadline_s <= now and e.sending == 0
            )

    def _extend(self, entry: SendEntry) -> None:
        entry.deadline_s = max(entry.deadline_s, self._clock() + self.lease_s)
