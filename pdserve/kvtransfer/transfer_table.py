"""A producer's record of transfer ids, and the early pulls that wait for a hold.

``KVProducer`` (kvtransfer/connector.py) keeps one ``TransferTable``: an id enters when a
Prefill is admitted (``admit``) or an early pull asks for it first (``wait_held``), is held
(``hold``: with the request's first tokens and, for a model with per-group tables, the held
tables of its other KV groups), and leaves with all of it when freed, failed or aborted
(``forget``) or refused before admission (``refuse``). An early pull (decode opened with the prefill leg) may come before its prefill is
admitted: ``wait_held`` waits for the hold on the event loop (no thread), and fails as soon as
the prefill ends without holding. Ids that ended are remembered (``ENDED_KEEP`` at most), so a
pull that comes after its prefill ended fails at once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdserve.errors import InvalidRequestError
from pdserve.kvtransfer.send_tracker import KVSendTracker, UnknownTransferError


class DuplicateTransferError(InvalidRequestError):
    """A prefill for a transfer_id this node already prefills or holds; maps to ALREADY_EXISTS."""


ENDED_KEEP = 65536  # transfer ids KVProducer remembers as ended (an id is 32 hex characters)
ADMIT_GRACE_S = 5.0  # an early pull whose Prefill was not admitted within this fails (NOT_FOUND)


@dataclass
class _Transfer:
    """One transfer_id's state on a producer, from its admission (or its first early pull) until
    it is forgotten (freed, failed, aborted)."""

    admitted: bool  # a Prefill admitted it (expect/admit/on_hold); False: only early pulls wait
    held: threading.Event = field(default_factory=threading.Event)  # its KV is held (on_hold)
    first_token_ids: list[int] = field(default_factory=list)  # the request's tokens when held
    # the held tables of the KV groups after the first (a model with per-group tables)
    group_block_ids: tuple[tuple[int, ...], ...] = ()
    # early pulls waiting for the hold: resolved True (held) or False (ended without holding)
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[bool]]] = field(default_factory=list)


def _resolve(fut: asyncio.Future[bool], held: bool) -> None:
    if not fut.done():  # a waiter that timed out or was cancelled meanwhile
        fut.set_result(held)


def _wake(waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[bool]]], held: bool) -> None:
    """Any thread: resolve early pulls' futures on their loops."""
    for loop, fut in waiters:
        with contextlib.suppress(RuntimeError):  # loop closed: the node is shutting down
            loop.call_soon_threadsafe(_resolve, fut, held)


class TransferTable:
    """Transfer ids admitted, held or awaited by an early pull on one producer, and the ids that
    ended there. Thread-safe: ``hold`` runs on the engine thread, the rest on gRPC workers and
    the event loop. ``tracker``: the producer's send tracker (its ids are held now)."""

    def __init__(self, tracker: KVSendTracker) -> None:
        self._tracker = tracker
        self._transfers: dict[str, _Transfer] = {}  # admitted / held / early-awaited transfers
        # transfer_id -> when it ended here (forgotten, or refused before admission): an early
        # pull that comes after its prefill ended fails at once instead of waiting out its
        # timeout with decode's blocks allocated for nothing. Bounded, oldest dropped first.
        self._ended: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._lock = threading.Lock()

    def admit(self, transfer_id: str) -> None:
        """A prefill for ``transfer_id`` was admitted: a push may wait for it. Refuses a
        transfer_id already admitted or held: a second request with it would collide with the
        first one's hold (refused here, before the engine thread, where a refused hold would fail
        every request on the node). Early pulls waiting for a
        transfer_id no prefill admitted yet (``wait_held``) do not make it a duplicate."""
        with self._lock:
            t = self._transfers.get(transfer_id)
            if (t is not None and t.admitted) or transfer_id in self._tracker:
                raise DuplicateTransferError(
                    f"transfer_id {transfer_id!r} is already in use on this node; mint a new one",
                    field="transfer_id",
                )
            if t is None:
                self._transfers[transfer_id] = _Transfer(admitted=True)
            else:
                t.admitted = True  # early pulls wait for it already

    def refuse(self, transfer_id: str) -> None:
        """A prefill for ``transfer_id`` was refused before its admission (or its RPC ended):
        early pulls waiting for it fail now, and so does one that comes later (an admitted
        transfer, another request's, is left alone)."""
        with self._lock:
            t = self._transfers.get(transfer_id)
            if t is not None and t.admitted:
                return
            self._note_ended(transfer_id)
            if t is None:
                return
            del self._transfers[transfer_id]
        _wake(t.waiters, False)

    def forget(self, transfer_id: str) -> None:
        """Drop the transfer's state (freed, failed, aborted); early pulls still waiting for its
        hold fail now, and so does one that comes later."""
        with self._lock:
            t = self._transfers.pop(transfer_id, None)
            self._note_ended(transfer_id)
        if t is not None:
            _wake(t.waiters, False)

    def __len__(self) -> int:
        """Transfers admitted, held or awaited by an early pull now (0 once none is in flight;
        the bounded record of ended ids is not counted)."""
        with self._lock:
            return len(self._transfers)

    def _note_ended(self, transfer_id: str) -> None:
        """Under the lock: remember that ``transfer_id`` ended here (ENDED_KEEP ids at most)."""
        self._ended[transfer_id] = time.monotonic()
        self._ended.move_to_end(transfer_id)
        while len(self._ended) > ENDED_KEEP:
            self._ended.popitem(last=False)

    def ended(self, transfer_id: str) -> bool:
        """Whether ``transfer_id`` ended here (among the last ENDED_KEEP that did)."""
        with self._lock:
            return transfer_id in self._ended

    def hold(
        self,
        transfer_id: str,
        add: Callable[[], None],
        first_token_ids: Sequence[int],
        group_block_ids: Sequence[Sequence[int]] = (),
    ) -> None:
        """Engine thread: ``add()`` holds the request's blocks (in the send tracker); then the
        transfer is held with ``first_token_ids`` (what every push answers with), and early pulls
        waiting for it are woken. ``group_block_ids``: the held tables of the KV groups after the
        first, recorded with the transfer (``forget`` drops both at once)."""
        with self._lock:
            t = self._transfers.setdefault(transfer_id, _Transfer(admitted=True))
            if group_block_ids:
                t.group_block_ids = tuple(tuple(g) for g in group_block_ids)
        add()
        with self._lock:
            t.first_token_ids = list(first_token_ids)
            t.held.set()
            waiters, t.waiters = t.waiters, []
        _wake(waiters, True)

    def group_block_ids(self, transfer_id: str) -> tuple[tuple[int, ...], ...]:
        """The held group tables of ``transfer_id`` (() if none or not held)."""
        with self._lock:
            t = self._transfers.get(transfer_id)
            return t.group_block_ids if t is not None else ()

    def first_token_ids(self, transfer_id: str) -> list[int]:
        """The tokens the transfer's request had when its KV was held ([] if not held or freed)."""
        with self._lock:
            t = self._transfers.get(transfer_id)
            return list(t.first_token_ids) if t is not None else []

    def expected(self, transfer_id: str) -> threading.Event:
        """The transfer's held event; KeyError if no prefill of it was admitted."""
        with self._lock:
            t = self._transfers.get(transfer_id)
        if t is None or not t.admitted:
            raise KeyError(transfer_id)
        return t.held

    async def wait_held(self, transfer_id: str, timeout_s: float) -> bool:
        """An early pull (asked while the prompt may still be prefilled, maybe before its prefill
        was admitted here): wait on the running loop, holding no thread, until the transfer's KV
        is held. True: held (at once if already); False: nothing held within ``timeout_s``, and
        nothing is left behind for a transfer that never came. Raises UnknownTransferError when
        its prefill ended (failed, aborted, refused) without holding the KV.

        Races: the waiter registers under the lock that ``hold`` / ``forget`` take to hand
        over the waiters, so it either sees the hold / the missing state, or is woken by them
        (``loop.call_soon_threadsafe`` from whatever thread they run on)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bool] = loop.create_future()
        with self._lock:
            t = self._transfers.get(transfer_id)
            if t is None and transfer_id in self._tracker:
                # Held, its state dropped (aborted while a push was in flight): the push answers.
                return True
            if t is None and transfer_id in self._ended:  # its prefill came and went first
                raise UnknownTransferError(transfer_id, "its prefill ended without holding its KV")
            if t is None:
                t = self._transfers[transfer_id] = _Transfer(admitted=False)
            if t.held.is_set():
                return True
            t.waiters.append((loop, fut))
        held: bool | None = None
        never_admitted = False
        deadline = loop.time() + timeout_s
        try:
            # Its Prefill is sent together with the decode leg: one not admitted here within
            # ADMIT_GRACE_S is not coming (cancelled before it was sent, or its Abort was lost),
            # and decode's blocks would wait the whole timeout for it.
            try:
                held = await asyncio.wait_for(asyncio.shield(fut), min(timeout_s, ADMIT_GRACE_S))
            except TimeoutError:
                with self._lock:
                    t = self._transfers.get(transfer_id)
                    admitted = t is not None and t.admitted
                if not admitted and timeout_s > ADMIT_GRACE_S:
                    never_admitted = True
                    held = False
                elif timeout_s > ADMIT_GRACE_S:
                    held = await asyncio.wait_for(fut, max(0.0, deadline - loop.time()))
        except TimeoutError:
            pass
        finally:
            with self._lock:
                t = self._transfers.get(transfer_id)
                if t is not None:
                    with contextlib.suppress(ValueError):
                        t.waiters.remove((loop, fut))
                    if held is None and t.held.is_set():
                        held = True  # held just as the timeout fired
                    if not t.admitted and not t.waiters and not t.held.is_set():
                        del self._transfers[transfer_id]  # no prefill came, nobody else waits
        if held is None:
            return False
        if never_admitted:
            raise UnknownTransferError(
                transfer_id, f"no prefill of it was admitted within {ADMIT_GRACE_S:g} s"
            )
        if not held:
            raise UnknownTransferError(transfer_id, "its prefill ended without holding its KV")
        return True
