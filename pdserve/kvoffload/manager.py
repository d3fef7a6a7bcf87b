"""The offload tier's scheduler side: which blocks are stored, found and loaded. No torch.

    BlockPool.allocate evicts a cached block --on_evict--> a store into a host slot
    Scheduler admits a request --lookup--> OffloadHit (host slots, pinned)
                             --commit(block ids)--> loads into the freshly allocated blocks
    Scheduler.schedule ends  --take_spec--> SchedulerOutput.kv_offload (the worker copies)
    next schedule            --begin_step(fence)--> pins of copies the fence passed are dropped

A host slot whose copy may still be queued is pinned (never evicted or reused) until the step
that copies it has completed. With a disk tier, a block leaving the host tier is written to disk
(the worker's queued stores are waited for first); without a host budget the host slots are only
a staging area whose blocks move to disk at the next step and never answer a lookup there.
A disk hit is read and checked here, into a host slot, before the request's first step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

from pdserve.kvoffload.disk import DiskTier
from pdserve.kvoffload.host import HostTier
from pdserve.kvoffload.spec import KVOffloadSpec, OffloadHit

# Buckets of pdserve:kv_offload_load_seconds.
LOAD_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class TierListener(Protocol):
    def tier_stored(self, block_hash: bytes, parent_hash: bytes | None, tier: str) -> None: ...
    def tier_removed(self, block_hash: bytes, tier: str) -> None: ...


def _tier_hook(listener: TierListener, tier: str) -> Callable[[bool, bytes], None]:
    def hook(stored: bool, block_hash: bytes) -> None:
        if stored:
            listener.tier_stored(block_hash, None, tier)
        else:
            listener.tier_removed(block_hash, tier)

    return hook


class KVOffloadManager:
    """Mutates the tiers, its pins and counters; ``wait_stores`` waits for the worker's queued stores."""

    def __init__(
        self,
        host: HostTier,
        disk: DiskTier | None,
        block_size: int,
        *,
        host_serves_hits: bool,
        wait_stores: Callable[[], None],
        stores_complete_with_step: bool = False,
    ) -> None:
        """``stores_complete_with_step``: other processes store too (pipeline stages), so a stored
        slot is read (for the disk tier) only once its step completed, not after ``wait_stores``."""
        self.host = host
        self.disk = disk
        self.block_size = block_size
        self.host_serves_hits = host_serves_hits
        self._wait_stores = wait_stores
        self._spec = KVOffloadSpec()
        self._pins: list[tuple[int, list[int]]] = []  # (step seq after which to unpin, slots)
        # Without a host budget: slots to give back (each holds one pin of its own), with the
        # hash of a store to write to disk first (None: a disk read, already there).
        self._staged: list[tuple[bytes | None, int]] = []
        self._staged_seq: dict[int, int] | None = {} if stores_complete_with_step else None
        # metrics
        self.num_stored_blocks = 0
        self.num_dropped_blocks = 0  # evicted blocks no tier could take (every host slot pinned)
        # Tokens a tier held but a lookup could not use (a corrupt file, no host slot to read into):
        # the failing block and the run the tiers hold after it.
        self.num_declined_tokens = 0
        self.hit_tokens = {"cpu": 0, "disk": 0}
        self.load_seconds_sum = 0.0
        self.load_seconds_counts = [0] * (len(LOAD_SECONDS_BUCKETS) + 1)

    def set_listener(self, listener: TierListener) -> None:
        """Tell ``listener`` (the node's KV event publisher) of every block the tiers index or drop:
        tier "cpu" (host entries that answer lookups) and "disk"."""
        self.host.on_change = _tier_hook(listener, "cpu")
        if self.disk is not None:
            self.disk.on_change = _tier_hook(listener, "disk")

    # -- stores ------------------------------------------------------------------------------
    def on_evict(self, block_id: int, block_hash: bytes) -> None:
        """BlockPool hook: a cached block is being reused; copy it out before this step writes it."""
        if self.host_serves_hits and self.host.get(block_hash) is not None:
            return  # the tier already holds these bytes
        if not self.host_serves_hits and self.disk is not None and block_hash in self.disk:
            return
        slot = self._take_slot()
        if slot is None:
            self.num_dropped_blocks += 1
            return
        self.host.pin(slot)
        self._spec.stores.append((block_id, slot))
        self.num_stored_blocks += 1
        if self.host_serves_hits:
            self.host.insert(block_hash, slot)
        else:
            self._staged.append((block_hash, slot))

    def _take_slot(self) -> int | None:
        taken = self.host.take_slot()
        if taken is None:
            return None
        slot, evicted = taken
        if evicted is not None and self.disk is not None:
            self._wait_stores()
            self.disk.put(evicted[0], self.host.view(evicted[1]))
        return slot

    # -- lookups and loads -------------------------------------------------------------------
    def lookup(self, block_hashes: Sequence[bytes]) -> OffloadHit | None:
        """The longest run of ``block_hashes`` (from the start) a tier holds, pinned in host
        slots; disk blocks are read and checked now (a bad file ends the run: a miss)."""
        t0 = time.perf_counter()
        slots: list[int] = []
        tiers: list[str] = []
        for i, h in enumerate(block_hashes):
            slot = self.host.get(h) if self.host_serves_hits else None
            if slot is not None:
                self.host.pin(slot)
                slots.append(slot)
                tiers.append("cpu")
                continue
            if self.disk is None or h not in self.disk:
                break
            slot = self._read_disk(h)
            if slot is None:
                self.num_declined_tokens += self.block_size * (1 + self._held_run(block_hashes[i + 1 :]))
                break
            slots.append(slot)
            tiers.append("disk")
        if not slots:
            return None
        self._spec.read_s += time.perf_counter() - t0
        return OffloadHit(slots, tiers, self.block_size)

    def _held_run(self, block_hashes: Sequence[bytes]) -> int:
        n = 0
        for h in block_hashes:
            in_host = self.host_serves_hits and h in self.host.entries
            if not (in_host or (self.disk is not None and h in self.disk)):
                break
            n += 1
        return n

    def _read_disk(self, block_hash: bytes) -> int | None:
        assert self.disk is not None
        payload = self.disk.get(block_hash)
        if payload is None:
            return None
        slot = self._take_slot()
        if slot is None:
            return None
        self.host.view(slot)[:] = payload
        self.host.pin(slot)  # the load's pin (commit / cancel)
        if self.host_serves_hits:
            self.host.insert(block_hash, slot)  # promoted: the next hit is a host hit
        else:
            self.host.pin(slot)  # the staging pin: the slot is given back once the load is done
            self._staged.append((None, slot))
        return slot

    def cancel(self, hit: OffloadHit) -> None:
        """The allocation after a lookup failed: drop its pins."""
        for slot in hit.slots:
            self.host.unpin(slot)

    def commit(self, hit: OffloadHit, block_ids: Sequence[int], step_seq: int) -> None:
        """Load ``hit`` into ``block_ids`` (fresh blocks of the request) in step ``step_seq``."""
        assert len(block_ids) == len(hit.slots)
        self._spec.loads.extend(zip(block_ids, hit.slots, strict=True))
        for tier in hit.tiers:
            self.hit_tokens[tier] += self.block_size
        self._pins.append((step_seq, hit.slots))

    # -- per step ----------------------------------------------------------------------------
    def begin_step(self, completed_seq: int) -> None:
        """Drop the pins of copies in steps up to ``completed_seq``; move staged blocks to disk."""
        keep = []
        for seq, slots in self._pins:
            if seq <= completed_seq:
                for slot in slots:
                    self.host.unpin(slot)
            else:
                keep.append((seq, slots))
        self._pins = keep
        if self._staged:
            staged, self._staged = self._staged, []
            self._wait_stores()
            for block_hash, slot in staged:
                if self.host.pin_count(slot) > 1 or not self._store_completed(slot, completed_seq):
                    self._staged.append((block_hash, slot))  # a load still reads it, a store writes
                    continue
                self.host.unpin(slot)
                if block_hash is not None and self.disk is not None:
                    self.disk.put(block_hash, self.host.view(slot))
                self.host.release(slot)

    def _store_completed(self, slot: int, completed_seq: int) -> bool:
        if self._staged_seq is None:
            return True  # wait_stores covers every store
        seq = self._staged_seq.get(slot)
        if seq is None or seq <= completed_seq:
            self._staged_seq.pop(slot, None)
            return True
        return False

    def take_spec(self, step_seq: int) -> KVOffloadSpec:
        """This step's copies. Store pins are dropped once ``step_seq`` completed."""
        spec, self._spec = self._spec, KVOffloadSpec()
        if self.host_serves_hits and spec.stores:
            self._pins.append((step_seq, [slot for _, slot in spec.stores]))
        elif self._staged_seq is not None:
            self._staged_seq.update((slot, step_seq) for _, slot in spec.stores)
        return spec

    def record_load(self, seconds: float) -> None:
        self.load_seconds_sum += seconds
        for i, b in enumerate(LOAD_SECONDS_BUCKETS):
            if seconds <= b:
                self.load_seconds_counts[i] += 1
                return
        self.load_seconds_counts[-1] += 1

    @property
    def num_corrupt_blocks(self) -> int:
        return self.disk.num_corrupt if self.disk is not None else 0

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
