"""Which blocks each request holds; prefix hits; deferred frees behind the step fence.

Ints and ids only (no torch).

Deferred frees (docs/design.md §4): a block that an in-flight step or KV transfer may still write is
freed only after the fence (the highest step sequence number known to have completed) passed
the last step that wrote it, and when no transfer into it is in flight.

    step seq:     ... 7        8 (scheduled, running)     9 (being scheduled)
    fence:            ^ completed_seq = 7
    a request last written by step 8 cannot be freed while scheduling 9 -> free is deferred
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from pdserve.engine.kv_cache_groups import FULL_ATTENTION, KVCacheCoordinator, KVCacheGroupSpec
from pdserve.engine.kv_group_tables import GroupTables
from pdserve.engine.request import Request

if TYPE_CHECKING:
    from pdserve.kvoffload.manager import KVOffloadManager
    from pdserve.kvoffload.spec import OffloadHit


@dataclass
class StepFence:
    """The highest step sequence number whose model execution has completed.

    The engine advances it after each executed step; tests inject one that does not advance.
    """

    completed_seq: int = 0

    def advance(self, seq: int) -> None:
        assert seq >= self.completed_seq
        self.completed_seq = seq


@dataclass
class _ReqState:
    blocks: list[KVCacheBlock] = field(default_factory=list)
    # [b.block_id for b in blocks], kept in step: an int32 array the runner copies with memcpy
    block_ids: array = field(default_factory=lambda: array("i"))
    num_hashed_blocks: int = 0  # blocks already registered in the prefix cache
    last_write_seq: int = 0  # last step that writes into these blocks
    inflight_writes: int = 0  # KV transfers writing into these blocks right now


class KVCacheManager:
    """Allocates and frees a request's blocks. Mutates the block pool and its own per-request map."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        fence: StepFence | None = None,
        groups: list[KVCacheGroupSpec] | None = None,
        group_num_blocks: tuple[int, ...] | None = None,
    ) -> None:
        """``group_num_blocks`` (blocks of each group after the first): each of those groups
        gets its own pool and block table per request (engine/kv_group_tables.py); None: every
        group reads this manager's one table (``num_blocks`` is group 0's pool)."""
        self.block_size = block_size
        # Every group's geometry and the rounding of hits across them.
        self.coordinator = KVCacheCoordinator(groups or [KVCacheGroupSpec(FULL_ATTENTION, (), block_size)])
        assert set(self.coordinator.group_block_sizes) == {block_size}, self.coordinator.group_block_sizes
        self.groups: GroupTables | None = None
        if group_num_blocks is not None:
            assert self.coordinator.managers[0].spec.kind == FULL_ATTENTION
            managers = self.coordinator.managers[1:]
            self.groups = GroupTables(managers, group_num_blocks, enable_prefix_caching)
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.fence = fence if fence is not None else StepFence()
        self._reqs: dict[str, _ReqState] = {}
        # (seq after which the blocks may be freed, blocks).
        self._deferred: deque[tuple[int, list[KVCacheBlock]]] = deque()
        self.enable_prefix_caching = enable_prefix_caching
        self.offload: KVOffloadManager | None = None  # the offload tier (set by KVOffloadTier)

    # -- queries -------------------------------------------------------------------------
    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (a copy)."""
        st = self._reqs.get(request_id)
        return list(st.block_ids) if st else []

    def block_ids_view(self, request_id: str) -> array:
        """The request's block table itself ('i' array), for this step's chunk: read it, never
        mutate it; the next allocation for the request extends it."""
        st = self._reqs.get(request_id)
        return st.block_ids if st else array("i")

    def group_block_ids_views(self, request_id: str) -> tuple[array, ...]:
        """The block tables of the groups after the first (empty without per-group tables)."""
        return self.groups.views(request_id) if self.groups is not None else ()

    def holds(self, request_id: str) -> bool:
        return request_id in self._reqs

    @property
    def num_held_requests(self) -> int:
        return len(self._reqs)

    @property
    def num_deferred_blocks(self) -> int:
        n = self.groups.num_deferred_blocks if self.groups is not None else 0
        return n + sum(len(b) for _, b in self._deferred)

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _update_hashes(self, req: Request) -> None:
        """Extend ``req.block_hashes`` to cover every full block of its current tokens."""
        bs = self.block_size
        n_full = req.num_tokens // bs
        hashes = req.block_hashes
        while len(hashes) < n_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(
                hash_block_tokens(
                    parent, req.token_ids_slice(i * bs, (i + 1) * bs), req.block_salt(i * bs, (i + 1) * bs)
                )
            )

    def get_computed_blocks(self, req: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest prefix-cache hit for a new request: (blocks, num tokens they cover).

        At least one token is always left to compute, since the model must produce logits.
        """
        if not self.enable_prefix_caching:
            return [], 0
        self._update_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits = self.pool.lookup(req.block_hashes[:max_blocks])
        self.pool.record_lookup(max_blocks, len(hits))
        if self.groups is not None:  # each group's own cached blocks, the hit pinned to them
            cached = [[True] * len(hits), *self.groups.cached_flags(req.block_hashes[:max_blocks])]
            hit = self.coordinator.longest_hit(cached, req.num_tokens - 1)
            hits = hits[: hit.num_tokens // self.block_size]
            if hits:
                self.groups.pin_hit(req.request_id, req.block_hashes, hit.num_tokens)
        elif len(self.coordinator.managers) > 1:  # the groups share the table: each sees these blocks
            present = [True] * len(hits)
            hit = self.coordinator.longest_hit([present] * len(self.coordinator.managers), req.num_tokens - 1)
            hits = hits[: hit.num_tokens // self.block_size]
        return hits, len(hits) * self.block_size

    def get_offloaded_blocks(self, req: Request, num_device_hit_blocks: int) -> OffloadHit | None:
        """The offload tier's hit for the blocks after the device hit (pinned: ``commit`` or
        ``cancel`` it); like a device hit, it leaves at least one token to compute."""
        if self.offload is None or not self.enable_prefix_caching:
            return None
        max_blocks = (req.num_tokens - 1) // self.block_size
        return self.offload.lookup(req.block_hashes[num_device_hit_blocks:max_blocks])

    # -- allocation ----------------------------------------------------------------------
    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
        group_start: int | None = None,
    ) -> list[int] | None:
        """Make the request's blocks cover ``num_computed + num_new_computed + num_new_tokens``.

        Returns the newly allocated block ids, or None (changing nothing) if the pool is short.
        ``group_start``: the first position the request computes itself when it is not
        ``num_computed + num_new_computed`` (a remote prompt's KV: the windows of the groups
        after the first then get blocks from that position's window only).
        """
        st = self._reqs.get(req.request_id)
        total = req.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        if st is not None and not new_computed_blocks and total <= len(st.block_ids) * self.block_size:
            if self.groups is not None:  # blocks the windows left behind
                self._free_groups(st, self.groups.release(req.request_id, req.num_computed_tokens))
            return []  # the common decode step: the last block has room
        new_computed_blocks = new_computed_blocks or []
        have = len(st.blocks) if st else 0
        need = self.num_blocks_needed(total) - have - len(new_computed_blocks)
        # Hit blocks that are free right now also come out of the free count when touched.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(need, 0) > self.pool.num_free_blocks - num_free_hits:
            return None
        start = req.num_computed_tokens + num_new_computed_tokens if group_start is None else group_start
        if self.groups is not None and not self.groups.can_allocate(
            req.request_id, start, total, num_new_computed_tokens
        ):
            return None
        if st is None:
            st = self._reqs[req.request_id] = _ReqState()
        if self.groups is not None:
            released = self.groups.allocate(req.request_id, start, total, num_new_computed_tokens)
            self._free_groups(st, released)
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            st.blocks.extend(new_computed_blocks)
            st.block_ids.extend(b.block_id for b in new_computed_blocks)
            st.num_hashed_blocks = len(st.blocks)
        if need <= 0:
            return []
        new_blocks = self.pool.allocate(need)
        st.blocks.extend(new_blocks)
        new_ids = [b.block_id for b in new_blocks]
        st.block_ids.extend(new_ids)
        return new_ids

    def num_new_blocks(self, req: Request, num_new_tokens: int) -> int:
        """Blocks ``allocate_slots(req, num_new_tokens)`` would take from the pool (no prefix hit)."""
        st = self._reqs.get(req.request_id)
        have = len(st.block_ids) if st else 0
        return max(0, -(-(req.num_computed_tokens + num_new_tokens) // self.block_size) - have)

    def cache_computed_blocks(self, req: Request, num_computed_tokens: int | None = None) -> None:
        """Register the request's blocks that became full and computed (after a step ran).

        ``num_computed_tokens``: positions whose KV is written (default: the request's counter,
        which may run ahead of the GPU under asynchronous scheduling).
        """
        if not self.enable_prefix_caching:
            return
        st = self._reqs.get(req.request_id)
        if st is None:
            return
        self._update_hashes(req)
        done = req.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        n_full = min(done // self.block_size, len(st.blocks), len(req.block_hashes))
        for i in range(st.num_hashed_blocks, n_full):
            self.pool.cache_block(st.blocks[i], req.block_hashes[i], req.block_hashes[i - 1] if i else None)
        st.num_hashed_blocks = max(st.num_hashed_blocks, n_full)
        if self.groups is not None:
            self.groups.cache(req.request_id, req.block_hashes, n_full)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Return the request's blocks past those covering ``num_tokens`` positions (the slots of
        rejected draft tokens, pdserve.spec_decode), behind the fence like ``free``."""
        st = self._reqs.get(request_id)
        keep = self.num_blocks_needed(num_tokens)
        if st is None or len(st.blocks) <= keep:
            return
        assert st.num_hashed_blocks <= keep and st.inflight_writes == 0, request_id
        extra = st.blocks[keep:]
        del st.blocks[keep:]
        del st.block_ids[keep:]
        extra.reverse()
        if self.groups is not None:
            self._free_groups(st, self.groups.trim(request_id, keep))
        if st.last_write_seq <= self.fence.completed_seq:
            self.pool.free(extra)
        else:
            self._deferred.append((st.last_write_seq, extra))

    # -- fence and in-flight writes --------------------------------------------------------
    def mark_written(self, request_id: str, step_seq: int) -> None:
        st = self._reqs.get(request_id)
        if st is not None:
            st.last_write_seq = max(st.last_write_seq, step_seq)

    def begin_inflight_write(self, request_id: str) -> None:
        self._reqs[request_id].inflight_writes += 1

    def end_inflight_write(self, request_id: str) -> None:
        st = self._reqs.get(request_id)
        if st is not None:
            assert st.inflight_writes > 0
            st.inflight_writes -= 1

    def can_free_now(self, request_id: str) -> bool:
        """True when nothing may still write the request's blocks (the preemption check)."""
        st = self._reqs.get(request_id)
        if st is None:
            return True
        return st.inflight_writes == 0 and st.last_write_seq <= self.fence.completed_seq

    # -- freeing -------------------------------------------------------------------------
    def free(self, request_id: str) -> None:
        """Release the request's blocks: now if the fence allows, else after it passes.

        A request with a transfer still writing into its blocks must not be freed: the caller
        (the transfer connector) frees it when the write ends.
        """
        if self.groups is not None:
            self.groups.drop_pin(request_id)
        st = self._reqs.get(request_id)
        if st is None:
            return
        assert st.inflight_writes == 0, f"free of {request_id} while a KV write is in flight"
        del self._reqs[request_id]
        if self.groups is not None:
            self._free_groups(st, self.groups.take(request_id))
        blocks = list(reversed(st.blocks))
        if st.last_write_seq <= self.fence.completed_seq:
            self.pool.free(blocks)
        else:
            self._deferred.append((st.last_write_seq, blocks))

    def _free_groups(self, st: _ReqState, released: list[tuple[int, list[KVCacheBlock]]]) -> None:
        """Free blocks of the groups after the first, behind the fence like the request's own."""
        assert self.groups is not None
        if released:
            assert st.inflight_writes == 0, "group blocks released while a KV write is in flight"
            self.groups.free(released, st.last_write_seq, self.fence.completed_seq)

    def process_deferred_frees(self) -> int:
        """Free deferred blocks whose writers completed; returns how many blocks were freed."""
        done = self.fence.completed_seq
        n_groups = self.groups.process_deferred(done) if self.groups is not None else 0
        if not self._deferred:
            return n_groups
        keep: deque[tuple[int, list[KVCacheBlock]]] = deque()
        n = 0
        for seq, blocks in self._deferred:
            if seq <= done:
                self.pool.free(blocks)
                n += len(blocks)
            else:
                keep.append((seq, blocks))
        self._deferred = keep
        return n + n_groups
