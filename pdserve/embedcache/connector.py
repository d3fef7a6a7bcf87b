"""Embedding cache connector: the producer half (encoder) and the consumer half (prefill's first
stage), over the same transfer backend as KV (``pdserve.kvtransfer.backend``).

    producer (encoder)                         consumer (prefill, first stage)
    ------------------                         -------------------------------
    put(key, embeds): copy into its registered  lookup(key) in the Redis index -> entry
      buffer, publish the entry (ttl = lease)   reserve(entry): room in its registered buffer
                                                ask the producer to push(key, session, dst)
    push(key, peer, dst): one descriptor write  complete(rid): READY -> TAKEN -> tensor copy
                                                release(rid) (always, also on failure)

Embedding bytes live only in the producer's buffer; the index holds where. A producer evicts the
oldest entries when its buffer is full (and removes them from the index first).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import torch
from prometheus_client import CollectorRegistry, Counter

from pdserve.embedcache.index import DTYPE_BYTES, EmbeddingEntry, EmbeddingIndex
from pdserve.embedcache.reservation import Reservation, ReservationTable
from pdserve.errors import CapacityError, InvalidRequestError
from pdserve.kvtransfer.backend import TransferBackend

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    for name, d in _TORCH_DTYPES.items():
        if d == dtype:
            return name
    raise InvalidRequestError(f"embedding dtype {dtype} is not one of {sorted(_TORCH_DTYPES)}")


class EmbeddingProducer:
    """Owns a registered byte buffer of embeddings; thread-safe."""

    def __init__(
        self,
        node: str,
        backend: TransferBackend,
        index: EmbeddingIndex,
        capacity_bytes: int,
        lease_s: float,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.node, self.backend, self.index, self.lease_s = node, backend, index, lease_s
        self.buffer = torch.zeros(capacity_bytes, dtype=torch.uint8)
        self.base = self.buffer.data_ptr()
        backend.register(self.base, capacity_bytes)
        self._lock = threading.Lock()
        self._slots: OrderedDict[str, tuple[int, EmbeddingEntry]] = OrderedDict()  # key -> (offset, entry)
        self.bytes_pushed = Counter(
            "pdserve:ec_bytes_pushed",
            "Embedding bytes pushed to consumers",
            registry=registry or CollectorRegistry(),
        )

    @property
    def num_cached(self) -> int:
        return len(self._slots)

    @property
    def bytes_used(self) -> int:
        return sum(e.nbytes for _off, e in list(self._slots.values()))

    def has(self, key: str) -> bool:
        with self._lock:
            if key in self._slots:
                self._slots.move_to_end(key)
                return self.index.refresh(key, self.lease_s) or self._republish(key)
            return False

    def _republish(self, key: str) -> bool:
        self.index.publish(self._slots[key][1], self.lease_s)
        return True

    def _room(self, nbytes: int) -> int:
        while True:
            pos = 0
            for off, e in sorted(v for v in self._slots.values()):
                if off - pos >= nbytes:
                    return pos
                pos = off + e.nbytes
            if self.buffer.numel() - pos >= nbytes:
                return pos
            if not self._slots:
                raise CapacityError(
                    f"embedding of {nbytes} bytes exceeds the encoder buffer ({self.buffer.numel()})"
                )
            old, _ = self._slots.popitem(last=False)  # evict the least recently used entry
            self.index.remove(old)

    def put(self, key: str, embeds: torch.Tensor) -> EmbeddingEntry:
        """Store ``embeds`` ([T, hidden]) under ``key`` and publish it in the index."""
        t = embeds.detach().contiguous().cpu()
        raw = t.view(-1).view(torch.uint8)
        with self._lock:
            if key in self._slots:
                return self._slots[key][1]
            off = self._room(raw.numel())
            self.buffer[off : off + raw.numel()] = raw
            entry = EmbeddingEntry(
                key,
                self.node,
                self.backend.session_id,
                self.base + off,
                raw.numel(),
                dtype_name(t.dtype),
                (int(t.shape[0]), int(t.shape[1])),
            )
            self._slots[key] = (off, entry)
            self.index.publish(entry, self.lease_s)
            return entry

    def push(self, key: str, peer_session: str, dst_addr: int, nbytes: int, transfer_id: str) -> None:
        """Write ``key``'s bytes into the consumer's reserved buffer (KeyError if evicted)."""
        with self._lock:
            _off, entry = self._slots[key]
        if nbytes != entry.nbytes:
            raise InvalidRequestError(
                f"push of {key!r}: consumer reserved {nbytes} bytes, entry has {entry.nbytes}"
            )
        self.backend.write(peer_session, [(entry.base, dst_addr, entry.nbytes)], transfer_id=transfer_id)
        self.bytes_pushed.inc(entry.nbytes)

    def close(self) -> None:
        """Take this encoder's entries out of the index (their bytes go with it). Redis being
        gone already (a stack stopping together) is logged, not raised: the entries expire with
        their lease anyway, and a node must still stop cleanly."""
        from redis.exceptions import RedisError

        with self._lock:
            keys = list(self._slots)
            self._slots.clear()
        for i, key in enumerate(keys):
            try:
                self.index.remove(key)
            except (RedisError, OSError) as e:
                logger.warning(
                    "embedding index unreachable at close: %d entries left to expire with their lease (%s)",
                    len(keys) - i,
                    e,
                )
                return


class EmbeddingConsumer:
    """Reserves room for pushed embeddings in a registered buffer and hands them out as tensors."""

    def __init__(
        self,
        backend: TransferBackend,
        capacity_bytes: int,
        lease_s: float = 30.0,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.backend = backend
        self.buffer = torch.zeros(capacity_bytes, dtype=torch.uint8)
        self.base = self.buffer.data_ptr()
        backend.register(self.base, capacity_bytes)
        self.table = ReservationTable(capacity_bytes, lease_s)
        reg = registry or CollectorRegistry()
        self.bytes_received = Counter("pdserve:ec_bytes_received", "Embedding bytes received", registry=reg)
        self.reservation_expiries = Counter(
            "pdserve:ec_reservation_expiries", "Embedding reservations ended by their lease", registry=reg
        )

    def expire(self) -> int:
        """Free reservations past their lease (call periodically); counts them in the metric."""
        n = self.table.expire()
        self.reservation_expiries.inc(n)
        return n

    def reserve(self, entry: EmbeddingEntry) -> tuple[Reservation, int]:
        """(reservation, destination address) for ``entry``; the producer writes there."""
        assert entry.nbytes == entry.shape[0] * entry.shape[1] * DTYPE_BYTES[entry.dtype]
        r = self.table.reserve(entry.key, entry.nbytes)
        return r, self.base + r.offset

    def start_write(self, r: Reservation) -> None:
        """Call before asking the producer to push: from here the buffer is not freed under it."""
        if not self.table.begin_write(r.rid):
            raise CapacityError(f"embedding reservation for {r.key!r} expired before the push started")

    def complete(self, r: Reservation, entry: EmbeddingEntry, ok: bool) -> torch.Tensor | None:
        """After the producer's push: the embeddings (a copy), or None if it failed or expired.
        Always frees the reservation."""
        try:
            if not self.table.finish_write(r.rid, ok) or self.table.take(r.rid) is None:
                return None
            raw = self.buffer[r.offset : r.offset + r.nbytes].clone()
            self.bytes_received.inc(r.nbytes)
            return raw.view(_TORCH_DTYPES[entry.dtype]).view(entry.shape)
        finally:
            self.table.release(r.rid)
