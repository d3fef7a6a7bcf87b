"""Decode's record of one remote-prefill request's KV, from admission to the end of its leg.

    open()  ->  WAITING --pull starts--> PULLING --every stage written (checksum ok)--> READY
                   |                        \\--any stage failed--------------------> FAILED
                   \\--KeepAlive: prefill no longer holds it--> EXPIRED --pull--> FAILED

``forget()`` removes the record on every exit of the decode leg (finish, refusal, cancellation,
engine error); a pull in flight keeps its own reference and ends on it. Event loop only.
"""

from __future__ import annotations

import enum
import logging
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

logger = logging.getLogger(__name__)


class TransferState(enum.Enum):
    WAITING = "waiting"  # admitted, queued before its pull (KeepAlive extends prefill's lease)
    PULLING = "pulling"  # PushKV calls in flight, one per decode stage
    READY = "ready"  # every stage's KV written (and its checksum matched); the engine runs it
    FAILED = "failed"  # the pull failed; kv_load_failure_policy applied
    EXPIRED = "expired"  # prefill answered a KeepAlive without it: its pull fails without asking


_NEXT = {
    TransferState.WAITING: {TransferState.PULLING, TransferState.EXPIRED},
    TransferState.EXPIRED: {TransferState.FAILED},
    TransferState.PULLING: {TransferState.READY, TransferState.FAILED},
    TransferState.READY: set(),
    TransferState.FAILED: set(),
}


@dataclass
class PullRecord:
    """One request's transfer on decode (keyed by request id in ``PullTable``)."""

    request_id: str
    transfer_id: str
    prefill_address: str
    early: bool = False  # leg opened with its prefill leg: the pull brings the first token
    no_recompute: bool = False  # image items came without tensors: a failed pull cannot recompute
    state: TransferState = TransferState.WAITING
    reprefill: bool = False  # failed, and the router should re-drive it on another prefill node
    checksum: str = ""  # prefill's digest of the pushed blocks (kv_checksum)
    error: str = ""  # why it failed
    num_bytes: int = 0  # KV bytes the pull brought (every stage; traces)

    def move(self, to: TransferState) -> None:
        assert to in _NEXT[self.state], f"{self.transfer_id}: {self.state.name} -> {to.name}"
        self.state = to


class PullTable:
    """The records of the requests decode admitted with remote KV, by request id."""

    def __init__(self) -> None:
        self._records: dict[str, PullRecord] = {}

    def add(self, record: PullRecord) -> PullRecord:
        old = self._records.get(record.request_id)
        if old is not None:
            # the same request id admitted again before its previous leg ended (a re-prefill
            # racing the old leg's teardown): the new leg's record wins
            logger.warning("request %s admitted again; replacing its KV record", record.request_id)
        self._records[record.request_id] = record
        return record

    def get(self, request_id: str) -> PullRecord | None:
        return self._records.get(request_id)

    def pop(self, request_id: str) -> PullRecord | None:
        return self._records.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[PullRecord]:
        return iter(list(self._records.values()))

    def queued_by_peer(self) -> dict[str, list[PullRecord]]:
        """Prefill address -> the records waiting for their pull with the KV held there.

        Early legs are left out: their prefill may not hold the KV yet (their pull waits for it).
        A pull in flight needs no keep-alive (prefill never expires a hold it is sending from)."""
        out: dict[str, list[PullRecord]] = defaultdict(list)
        for r in self._records.values():
            if r.state is TransferState.WAITING and not r.early:
                out[r.prefill_address].append(r)
        return dict(out)
