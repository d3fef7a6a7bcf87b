"""The host-memory tier: fixed-size slots of one preallocated pool, keyed by block hash. No torch.

The pool's memory belongs to the worker side (``copier.KVOffloadCopier``: pinned on CUDA); this
tier only decides which slot holds which block and reads or writes slot bytes through a
memoryview. A slot is *pinned* while a copy into or out of it may still be queued (a store not yet
on the host, a load not yet on the device): pinned slots are never evicted or reused.

    entries: hash -> slot, least recently used first      free: slots holding nothing
    pins:    slot -> pin count
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class HostTier:
    """Mutates its entries, free slots and pins; the caller copies the bytes."""

    def __init__(self, buffer: memoryview, block_bytes: int, num_slots: int) -> None:
        assert block_bytes > 0 and num_slots > 0 and len(buffer) >= block_bytes * num_slots
        self.buffer = buffer
        self.block_bytes = block_bytes
        self.num_slots = num_slots
        self.entries: OrderedDict[bytes, int] = OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))
        self._pins: dict[int, int] = {}
        # (stored: bool, hash) for each entry made or dropped (KVOffloadManager.set_listener)
        self.on_change: Callable[[bool, bytes], None] | None = None

    @property
    def used_bytes(self) -> int:
        return len(self.entries) * self.block_bytes

    def view(self, slot: int) -> memoryview:
        return self.buffer[slot * self.block_bytes : (slot + 1) * self.block_bytes]

    def get(self, block_hash: bytes) -> int | None:
        """The slot holding ``block_hash`` (marked most recently used), or None."""
        slot = self.entries.get(block_hash)
        if slot is not None:
            self.entries.move_to_end(block_hash)
        return slot

    def pin(self, slot: int) -> None:
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        n = self._pins[slot] - 1
        if n:
            self._pins[slot] = n
        else:
            del self._pins[slot]

    def is_pinned(self, slot: int) -> bool:
        return slot in self._pins

    def pin_count(self, slot: int) -> int:
        return self._pins.get(slot, 0)

    def take_slot(self) -> tuple[int, tuple[bytes, int] | None] | None:
        """A slot to write into: a free one, else the least recently used unpinned entry's,
        evicted and returned as ``(hash, slot)`` so its bytes can move to a lower tier first.
        None: every slot is pinned (the caller drops the block)."""
        if self._free:
            return self._free.pop(), None
        for h, slot in self.entries.items():
            if slot not in self._pins:
                del self.entries[h]
                if self.on_change is not None:
                    self.on_change(False, h)
                return slot, (h, slot)
        return None

    def insert(self, block_hash: bytes, slot: int) -> None:
        assert block_hash not in self.entries
        self.entries[block_hash] = slot
        if self.on_change is not None:
            self.on_change(True, block_hash)

    def release(self, slot: int) -> None:
        """Give back a slot taken with ``take_slot`` that holds no entry."""
        assert slot not in self._pins
        self._free.append(slot)

    def remove(self, block_hash: bytes) -> int | None:
        """Drop an entry (its slot stays taken until ``release``); returns its slot."""
        slot = self.entries.pop(block_hash, None)
        if slot is not None and self.on_change is not None:
            self.on_change(False, block_hash)
        return slot
