"""The KV data plane: write local registered memory into a peer's registered memory.

``TransferBackend`` is the seam; ``MooncakeBackend`` is the real one (Mooncake Transfer Engine,
TCP or RDMA, peers meet in P2PHANDSHAKE mode), ``LoopbackBackend`` is an in-process fake for
unit tests. The prefill side is the writer: it owns the source ranges, decode owns the targets.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import itertools
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from pdserve.errors import PdserveError
from pdserve.kvtransfer.descriptors import Spans
from pdserve.kvtransfer.regions import MAX_DESCRIPTORS_PER_BATCH, Descriptors, descriptor_list, split_batches

# Writes of many descriptors (more than MANY_DESCRIPTORS) go in batches of WRITE_BATCH_DESCRIPTORS,
# at most WRITE_SLOTS_PER_PROCESS batches of a process in flight. Measured on loopback TCP
# (mooncake-transfer-engine-non-cuda 0.3.13, 2 processes x 4 threads writing 64-byte
# descriptors into one peer): about 2,048 descriptors in flight together all succeed; 3,072
# made some batches fail with -1, 16,384 (2,048 x 1 KiB each) made most fail after 30 s stalls.
# Head-slice pushes between TP sizes (kvtransfer/head_slices.py, HeadSlicePlan) carry
# 2 * block_size descriptors per block and layer; whole-block pushes have a few and are not held.
MANY_DESCRIPTORS = 64
WRITE_BATCH_DESCRIPTORS = 256
WRITE_SLOTS_PER_PROCESS = 2
_WRITE_SLOTS = threading.BoundedSemaphore(WRITE_SLOTS_PER_PROCESS)


class TransferError(PdserveError):
    """A transfer-engine call failed; names the peer, the transfer, the operation and the code.

    ``code`` is the engine's negative return code, or None when pdserve refused the call itself
    (unregistered memory, unknown peer, closed backend) before the engine saw it.
    """

    def __init__(self, peer: str, transfer_id: str, op: str, code: int | None, detail: str = "") -> None:
        code_txt = "refused before the engine call" if code is None else f"engine returned {code}"
        super().__init__(
            f"KV transfer {op} failed: peer={peer!r} transfer_id={transfer_id!r} {code_txt}"
            + (f": {detail}" if detail else "")
        )
        self.peer = peer
        self.transfer_id = transfer_id
        self.op = op
        self.code = code
        self.detail = detail


class _RangeSet:
    """Registered ``[addr, addr+length)`` ranges; answers "is this range inside one of them"."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._lengths: dict[int, int] = {}

    def add(self, addr: int, length: int) -> None:
        if length <= 0 or addr <= 0:
            raise ValueError(f"cannot register addr={addr:#x} length={length}")
        i = bisect.bisect_right(self._starts, addr)
        prev_overlaps = i > 0 and self._starts[i - 1] + self._lengths[self._starts[i - 1]] > addr
        next_overlaps = i < len(self._starts) and self._starts[i] < addr + length
        if prev_overlaps or next_overlaps:
            raise ValueError(f"range {addr:#x}+{length} overlaps an already registered range")
        self._starts.insert(i, addr)
        self._lengths[addr] = length

    def remove(self, addr: int) -> None:
        del self._lengths[addr]  # KeyError for an address never registered
        self._starts.remove(addr)

    def contains(self, addr: int, length: int) -> bool:
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0:
            return False
        start = self._starts[i]
        return addr + length <= start + self._lengths[start]

    def first_outside(self, addrs: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
        for addr, length in addrs:
            if not self.contains(addr, length):
                return (addr, length)
        return None

    def __iter__(self):
        return iter(list(self._starts))


class TransferBackend(ABC):
    """Moves bytes from this process's registered memory into a peer's registered memory.

    Mutates only the peer's memory named by the descriptors' destination ranges (and its own
    table of registered ranges in ``register`` / ``unregister``). It never frees memory: the
    caller keeps every registered buffer alive until after ``unregister`` (or ``close``).
    Calls may come from several threads.
    """

    @property
    @abstractmethod
    def session_id(self) -> str:
        """The address peers pass to ``write`` to reach this backend (``"host:port"``)."""

    @abstractmethod
    def register(self, addr: int, length: int) -> None:
        """Make ``[addr, addr+length)`` usable as a write source here and a write target for peers."""

    @abstractmethod
    def unregister(self, addr: int) -> None:
        """Forget the range registered at ``addr``; in-flight writes to it must have ended."""

    @abstractmethod
    def write(self, peer_session: str, descs: Descriptors, *, transfer_id: str) -> None:
        """Copy every ``(src_addr, dst_addr, length)`` into the peer; returns when all bytes landed.

        ``descs``: a list of tuples or an int64 array [n, 3] of those rows (``DescriptorTable``).

        Sources must lie inside this backend's registered memory. Chunked at the engine's
        per-call limit; raises TransferError on the first failed chunk (earlier chunks stay written).
        """

    def write_spanned(
        self, peer_session: str, descs: Descriptors, spans: Spans | None, *, transfer_id: str
    ) -> None:
        """``write`` of descriptors whose spans the caller knows (``Spans``, from
        ``DescriptorPlan.descriptors_spans``; None: not known): a backend that checks whether
        the ranges lie in registered memory checks the spans instead of every descriptor. The
        same effect as ``write``; this default (no such check) ignores them."""
        self.write(peer_session, descs, transfer_id=transfer_id)

    @abstractmethod
    def close(self) -> None:
        """Unregister everything and release the engine; idempotent."""


class MooncakeBackend(TransferBackend):
    """Mooncake Transfer Engine backend (``mooncake.engine.TransferEngine``).

    ``host`` is the address peers use; with TCP it is also exported as ``MC_TCP_BIND_ADDRESS``
    (unless already set) because Mooncake otherwise advertises eth0's address. Neither moves
    where its ports listen: every interface (kvtransfer/exposure.py, checked at node start).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        metadata_server: str = "P2PHANDSHAKE",
    ) -> None:
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
        from mooncake.engine import TransferEngine  # imported late: the wheel is optional

        self._host = host
        self._lock = threading.Lock()
        self._ranges = _RangeSet()
        self._engine: TransferEngine | None = TransferEngine()
        code = self._engine.initialize(host, metadata_server, protocol, device_name)
        if code < 0:
            raise TransferError(host, "-", f"initialize({protocol}, {metadata_server})", code)
        self._session_id = f"{host}:{self._engine.get_rpc_port()}"

    @property
    def session_id(self) -> str:
        return self._session_id

    def _live_engine(self, op: str, peer: str, transfer_id: str):
        engine = self._engine
        if engine is None:
            raise TransferError(peer, transfer_id, op, None, "backend is closed")
        return engine

    def register(self, addr: int, length: int) -> None:
        engine = self._live_engine("register", self._session_id, "-")
        with self._lock:
            self._ranges.add(addr, length)
            code = engine.register_memory(addr, length)
            if code < 0:
                self._ranges.remove(addr)
                raise TransferError(self._session_id, "-", f"register({addr:#x}, {length})", code)

    def unregister(self, addr: int) -> None:
        engine = self._live_engine("unregister", self._session_id, "-")
        with self._lock:
            try:
                self._ranges.remove(addr)
            except KeyError:
                raise TransferError(
                    self._session_id, "-", f"unregister({addr:#x})", None, "not registered"
                ) from None
            code = engine.unregister_memory(addr)
        if code < 0:
            raise TransferError(self._session_id, "-", f"unregister({addr:#x})", code)

    def write(self, peer_session: str, descs: Descriptors, *, transfer_id: str) -> None:
        self.write_spanned(peer_session, descs, None, transfer_id=transfer_id)

    def write_spanned(
        self, peer_session: str, descs: Descriptors, spans: Spans | None, *, transfer_id: str
    ) -> None:
        engine = self._live_engine("write", peer_session, transfer_id)
        descs = descriptor_list(descs)  # the engine takes lists of Python ints
        with self._lock:
            # one registered range holding the sources' span answers for every descriptor
            inside = spans is not None and self._ranges.contains(spans[0], spans[1] - spans[0])
            bad = None if inside else self._ranges.first_outside([(s, n) for s, _, n in descs])
        if bad is not None:
            raise TransferError(
                peer_session,
                transfer_id,
                "write",
                None,
                f"source {bad[0]:#x}+{bad[1]} is not registered memory",
            )
        many = len(descs) > MANY_DESCRIPTORS
        for batch in split_batches(descs, WRITE_BATCH_DESCRIPTORS if many else MAX_DESCRIPTORS_PER_BATCH):
            srcs, dsts, lens = (list(col) for col in zip(*batch, strict=True))
            with _WRITE_SLOTS if many else contextlib.nullcontext():
                code = engine.batch_transfer_sync_write(peer_session, srcs, dsts, lens)
            if code < 0:
                raise TransferError(
                    peer_session,
                    transfer_id,
                    "write",
                    code,
                    f"batch of {len(batch)} descriptors, {sum(lens)} bytes",
                )

    def close(self) -> None:
        with self._lock:
            engine, self._engine = self._engine, None
            if engine is None:
                return
            for addr in self._ranges:
                engine.unregister_memory(addr)  # best effort at shutdown: the engine goes away next
                self._ranges.remove(addr)


class LoopbackBackend(TransferBackend):
    """In-process fake for unit tests: sessions live in a class-level table, writes are memmove.

    ``fail_next_writes`` makes the next N writes raise TransferError (code -1) without moving
    bytes, so callers can test their failure paths.
    """

    _sessions: ClassVar[dict[str, LoopbackBackend]] = {}
    _ids = itertools.count()
    _table_lock = threading.Lock()

    def __init__(self) -> None:
        self._session_id = f"loopback:{next(self._ids)}"
        self._ranges = _RangeSet()
        self._lock = threading.Lock()
        self.fail_next_writes = 0
        with self._table_lock:
            self._sessions[self._session_id] = self

    @property
    def session_id(self) -> str:
        return self._session_id

    def register(self, addr: int, length: int) -> None:
        with self._lock:
            self._ranges.add(addr, length)

    def unregister(self, addr: int) -> None:
        with self._lock:
            try:
                self._ranges.remove(addr)
            except KeyError:
                raise TransferError(
                    self._session_id, "-", f"unregister({addr:#x})", None, "not registered"
                ) from None

    def write(self, peer_session: str, descs: Descriptors, *, transfer_id: str) -> None:
        with self._table_lock:
            peer = self._sessions.get(peer_session)
        if peer is None or self._session_id not in self._sessions:
            raise TransferError(
                peer_session, transfer_id, "write", None, "no such loopback session (or closed)"
            )
        descs = descriptor_list(descs)  # ctypes.memmove takes Python ints
        for batch in split_batches(descs, MAX_DESCRIPTORS_PER_BATCH):
            if self.fail_next_writes > 0:
                self.fail_next_writes -= 1
                raise TransferError(peer_session, transfer_id, "write", -1, "injected failure")
            with self._lock:
                bad_src = self._ranges.first_outside([(s, n) for s, _, n in batch])
            with peer._lock:
                bad_dst = peer._ranges.first_outside([(d, n) for _, d, n in batch])
            # Same codes as MooncakeBackend: an unregistered source is refused here (None), an
            # unregistered target is refused by the peer (-1).
            if bad_src is not None:
                a, n = bad_src
                raise TransferError(
                    peer_session, transfer_id, "write", None, f"source {a:#x}+{n} is not registered"
                )
            if bad_dst is not None:
                a, n = bad_dst
                raise TransferError(
                    peer_session, transfer_id, "write", -1, f"target {a:#x}+{n} is not registered"
                )
            for src, dst, n in batch:
                ctypes.memmove(dst, src, n)

    def close(self) -> None:
        with self._table_lock:
            self._sessions.pop(self._session_id, None)
        with self._lock:
            self._ranges = _RangeSet()
