"""One Prefill call's transfer on the producer, from the call's start to its end.

    track(tid) -> NEW --admit()--> ADMITTED --finish()--> HELD    (KV held for its pulls)
                  |                   |  \\----finish()--> FAILED  (nothing held)
                  |                   \\--fail()---------> FAILED  (prefill failed / refused late)
                  |                    \\-cancel()-------> CANCELLED (caller gone: hold released)
                  \\--close() before admit()------------> REFUSED (early pulls for it fail now)

``close(cancelled)`` runs when the call ends, whatever ended it: a transfer never admitted is
refused (an early pull waiting for it fails now, not at its timeout); one whose caller cancelled
the call, even after its answer was ready (no exception tells the handler), is released now
instead of at its lease's end. Every transition is idempotent past its first end state.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.kvtransfer.connector import KVProducer


class ProducerTransferState(enum.Enum):
    NEW = "new"
    ADMITTED = "admitted"  # a prefill runs for it; early pulls may wait for its hold
    HELD = "held"  # the KV is held for its pulls; the send tracker frees it
    FAILED = "failed"  # ended without KV held
    CANCELLED = "cancelled"  # its caller went away; any hold was released
    REFUSED = "refused"  # never admitted


S = ProducerTransferState


class ProducerTransfer:
    def __init__(self, producer: KVProducer, transfer_id: str) -> None:
        self.producer = producer
        self.transfer_id = transfer_id
        self.state = S.NEW

    def admit(self) -> None:
        """The prefill is admitted; raises DuplicateTransferError if the id is in use here.
        (REFUSED too: a call whose end ran before its handler got here goes on as before; its
        hold, if any, ends with its lease.)"""
        assert self.state in (S.NEW, S.REFUSED), self.state
        self.producer.admit(self.transfer_id)
        self.state = S.ADMITTED

    def fail(self) -> None:
        """The prefill ended without its KV (error, overloaded): drop its state; early pulls fail."""
        if self.state is S.ADMITTED:
            self.producer.forget(self.transfer_id)
            self.state = S.FAILED

    def cancel(self) -> None:
        """The caller went away: release any hold now, not at the lease's end."""
        if self.state in (S.ADMITTED, S.HELD):
            self.producer.abort(self.transfer_id)
            self.producer.forget(self.transfer_id)
            self.state = S.CANCELLED

    def finish(self) -> bool:
        """The prefill produced its first token: HELD if its KV is held (True), else FAILED."""
        assert self.state is S.ADMITTED, self.state
        if self.transfer_id in self.producer.tracker:
            self.state = S.HELD
            return True
        self.fail()
        return False

    def close(self, cancelled: bool) -> None:
        """The Prefill call ended (any thread that runs its done callbacks)."""
        if self.state is S.NEW:
            self.producer.refuse(self.transfer_id)
            self.state = S.REFUSED
        elif cancelled:
            self.cancel()
