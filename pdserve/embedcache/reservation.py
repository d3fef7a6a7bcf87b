"""Consumer-side buffers for incoming embeddings: reservations with an explicit state and a lease.

A consumer (prefill's first stage) reserves room in its registered buffer before asking a producer
to push; the producer's write and the consumer's read follow the states below. No torch here.

    RESERVED --begin_write--> WRITING --finish_write--> READY --take--> TAKEN --release--> freed
        |                        |                        |
        +-- lease passes: freed  +-- lease passes: kept   +-- lease passes: freed
                                     until the writer ends (finish_write frees it, returns False)

A buffer is never freed while a writer is active (WRITING), and never leaks when a request dies:
every other state is freed by ``release`` or by ``expire`` after its lease.
"""

from __future__ import annotations

import enum
import itertools
import threading
import time
from dataclasses import dataclass

from pdserve.errors import CapacityError


class ReservationState(enum.Enum):
    RESERVED = "reserved"
    WRITING = "writing"
    READY = "ready"
    TAKEN = "taken"


@dataclass
class Reservation:
    rid: int
    key: str
    offset: int  # byte offset in the consumer's registered buffer
    nbytes: int
    state: ReservationState
    deadline: float  # monotonic time the lease ends
    expired: bool = False  # lease passed while WRITING: freed when the writer ends


class ReservationTable:
    """First-fit allocator over one registered buffer of ``capacity_bytes`` plus reservation states.

    Thread-safe (the gRPC threads of a node share it). Counts expiries in ``num_expired``."""

    def __init__(self, capacity_bytes: int, lease_s: float = 30.0, clock=time.monotonic) -> None:
        self.capacity_bytes = capacity_bytes
        self.lease_s = lease_s
        self._clock = clock
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._live: dict[int, Reservation] = {}
        self.num_expired = 0

    def _find_room(self, nbytes: int) -> int | None:
        pos = 0
        for r in sorted(self._live.values(), key=lambda r: r.offset):
            if r.offset - pos >= nbytes:
                return pos
            pos = max(pos, r.offset + r.nbytes)
        return pos if self.capacity_bytes - pos >= nbytes else None

    def reserve(self, key: str, nbytes: int) -> Reservation:
        assert nbytes > 0, nbytes
        with self._lock:
            self._expire_locked()
            offset = self._find_room(nbytes)
            if offset is None:
                raise CapacityError(
                    f"embedding buffer: no room for {nbytes} bytes of {key!r} "
                    f"({self.used_bytes_locked()} of {self.capacity_bytes} in use); raise ec_buffer_bytes"
                )
            r = Reservation(next(self._ids), key, offset, nbytes, ReservationState.RESERVED, self._deadline())
            self._live[r.rid] = r
            return r

    def _deadline(self) -> float:
        return self._clock() + self.lease_s

    def _move(self, rid: int, frm: ReservationState, to: ReservationState) -> Reservation | None:
        r = self._live.get(rid)
        if r is None or r.state is not frm:
            return None
        r.state, r.deadline = to, self._deadline()
        return r

    def begin_write(self, rid: int) -> bool:
        """RESERVED -> WRITING; False if the reservation is gone (expired or released)."""
        with self._lock:
            return self._move(rid, ReservationState.RESERVED, ReservationState.WRITING) is not None

    def finish_write(self, rid: int, ok: bool) -> bool:
        """WRITING -> READY (``ok``) or freed; False (and freed) if the lease passed meanwhile."""
        with self._lock:
            r = self._live.get(rid)
            assert r is not None and r.state is ReservationState.WRITING, (rid, r)
            if r.expired or not ok:
                del self._live[rid]
                return False
            self._move(rid, ReservationState.WRITING, ReservationState.READY)
            return True

    def take(self, rid: int) -> Reservation | None:
        """READY -> TAKEN: the reader owns the bytes until ``release``."""
        with self._lock:
            return self._move(rid, ReservationState.READY, ReservationState.TAKEN)

    def release(self, rid: int) -> None:
        """Free a reservation in any state but WRITING (then it is freed when the writer ends)."""
        with self._lock:
            r = self._live.get(rid)
            if r is None:
                return
            if r.state is ReservationState.WRITING:
                r.expired = True
            else:
                del self._live[rid]

    def expire(self) -> int:
        """Free reservations past their lease (WRITING ones are only marked); returns how many."""
        with self._lock:
            return self._expire_locked()

    def _expire_locked(self) -> int:
        now = self._clock()
        n = 0
        for r in list(self._live.values()):
            if r.deadline > now or r.expired:
                continue
            n += 1
            if r.state is ReservationState.WRITING:
                r.expired = True
            else:
                del self._live[r.rid]
        self.num_expired += n
        return n

    def used_bytes_locked(self) -> int:
        return sum(r.nbytes for r in self._live.values())

    @property
    def num_reserved(self) -> int:
        with self._lock:
            return len(self._live)
