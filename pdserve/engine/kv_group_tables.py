"""Block tables of the KV cache groups after the first: each group its own pool and its own
table per request, so a sliding-window group really gives back the blocks its window no longer
sees. Ints and ids only (no torch).

Group 0 (full attention) stays the ``KVCacheManager``'s own table and pool; every other group g
gets a ``BlockPool`` of its own (and, in the model runner, a KV tensor of its own holding only
its layers: ``engine/group_kv.py``). A table has one entry per block of the request's positions,
like group 0's; entries the group does not hold are ``NULL_BLOCK_ID``:

    positions       0 .. 15 | 16 .. 31 | 32 .. 47 | 48 .. 63 | 64 .. 79      (block size 16)
    group 0 table      7    |    3     |    9     |    4     |    12
    sliding (W=32)   NULL   |   NULL   |    5     |    2     |    8         num_computed = 70:
                                                                            keys from 70 - 32 + 1 = 39

Why a pool per group, not one pool whose blocks any group takes: a block id names a place in
one KV tensor, and the groups' tensors hold different layers (a shared pool would give each
block the bytes of every layer, so a block freed by the window would not shrink anything). With
a pool per group the memory split is chosen once (``plan_group_blocks``): a sliding-window
group gets what its windows can need at most, every other byte goes to group 0.

Block ``NULL_BLOCK_ID`` of each pool is taken at start and never freed: the attention of a
sliding layer gathers it for positions outside its window and masks them; nothing writes it.
"""

from __future__ import annotations

import logging
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdserve.config.engine import SchedulerConfig
from pdserve.engine.block_pool import BlockPool, KVCacheBlock
from pdserve.engine.kv_cache_groups import SHORT_CONV, WINDOWED_KINDS, GroupManager, KVCacheGroupSpec
from pdserve.errors import ConfigError
from pdserve.kvtransfer.group_transfer import NULL_BLOCK_ID

logger = logging.getLogger(__name__)


def tables_off_reason(
    specs: Sequence[KVCacheGroupSpec],
    *,
    single_runner: bool,
    kv_offload: bool,
    shared_reason: str | None = None,
) -> str | None:
    """Why a model's groups share group 0's table (every layer keeps the whole sequence), or
    None when each group gets its own table. The offload tier copies blocks of one KV tensor;
    TP ranks and pipeline stages build their tensors apart; ``shared_reason``: the node's own
    (its KV transfer settings, kvtransfer/group_transfer.py)."""
    if len(specs) < 2:
        return "the model has one KV group"
    if specs[0].kind in WINDOWED_KINDS:
        return "the model has no full-attention layer (group 0 keeps the shared table)"
    if shared_reason is not None:
        return shared_reason
    if kv_offload:
        return "kv_offload copies blocks of one KV tensor"
    if not single_runner:
        return "tensor parallel ranks and pipeline stages keep one KV tensor each"
    if len({s.block_size for s in specs}) > 1:
        return "the groups' block sizes differ (block hashes are taken at one size)"
    return None


def needs_own_tables(specs: Sequence[KVCacheGroupSpec]) -> bool:
    """Whether the model cannot run with its groups on one table: a short-convolution group's
    inputs do not fit an attention layer's KV slots."""
    return any(s.kind == SHORT_CONV for s in specs)


def window_blocks_bound(spec: KVCacheGroupSpec, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The most blocks a sliding-window group's requests hold at once: each running request its
    window's blocks (``ceil((W - 1) / bs)``) plus a partial block at each end, and one step's
    chunks (``ceil(max_num_batched_tokens / bs)`` in all), plus the null block."""
    assert spec.kind in WINDOWED_KINDS and spec.sliding_window is not None
    bs = spec.block_size
    per_request = -(-(spec.sliding_window - 1) // bs) + 2
    return max_num_seqs * per_request + -(-max_num_batched_tokens // bs) + 1


def plan_group_blocks(
    specs: Sequence[KVCacheGroupSpec],
    budget_bytes: int,
    layer_block_bytes: Sequence[int],
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> tuple[int, ...]:
    """Blocks per group from one byte budget (``layer_block_bytes[g]``: one layer of group g,
    one block: K and V, or a convolution's inputs). Each group after the first: what it can need
    at most (a window: ``window_blocks_bound``; else as many as group 0), never more than an
    equal split would give it; group 0 takes the rest."""
    group_bytes = [len(s.layer_names) * b for s, b in zip(specs, layer_block_bytes, strict=True)]
    equal = budget_bytes // sum(group_bytes)
    out = [0]
    for s, nbytes in zip(specs[1:], group_bytes[1:], strict=True):
        n = equal
        if s.kind in WINDOWED_KINDS:
            n = min(equal, window_blocks_bound(s, max_num_seqs, max_num_batched_tokens))
        out.append(max(n, 2))  # the null block and one more
        budget_bytes -= out[-1] * nbytes
    out[0] = budget_bytes // group_bytes[0]
    return tuple(out)


def split_kv_budget(
    specs: Sequence[KVCacheGroupSpec],
    off_reason: str | None,
    budget_bytes: int,
    layer_block_bytes: Callable[[], Sequence[int]],
    sched: SchedulerConfig,
    architecture: str,
) -> tuple[int, ...] | None:
    """Blocks per group when each group gets its own table and pool (``plan_group_blocks``);
    None when they share one (``off_reason``, from ``tables_off_reason``), which a model with a
    short-convolution group cannot do (ConfigError)."""
    if off_reason is not None:
        if needs_own_tables(specs):
            raise ConfigError(
                f"{architecture} keeps short-convolution state in a KV cache group of its own, which "
                f"needs a block table per group; not here: {off_reason}"
            )
        if len(specs) > 1:
            logger.info("KV cache groups share one block table: %s", off_reason)
        return None
    split = plan_group_blocks(
        specs, budget_bytes, layer_block_bytes(), sched.max_num_seqs, sched.max_num_batched_tokens
    )
    if split[0] < 1:
        raise ConfigError(
            f"the KV cache budget ({budget_bytes} bytes) leaves no block for the full-attention "
            f"layers once the other KV groups have theirs ({list(split[1:])} blocks); raise "
            "kv_cache_memory_bytes"
        )
    return split


@dataclass
class _Table:
    blocks: list[KVCacheBlock | None] = field(default_factory=list)  # None: NULL_BLOCK_ID
    block_ids: array = field(default_factory=lambda: array("i"))  # what the runner reads
    first_held: int = 0  # entries before this are NULL (freed or never held)


class GroupTables:
    """The tables of every group after group 0. Mutates its pools and per-request tables; the
    ``KVCacheManager`` calls it at each of its own steps (lookup, allocation, caching, trim,
    free) and frees what it returns behind its fence."""

    def __init__(
        self, managers: Sequence[GroupManager], num_blocks: Sequence[int], enable_caching: bool
    ) -> None:
        assert len(managers) == len(num_blocks) and managers
        self.managers = list(managers)
        self.pools = [BlockPool(n, enable_caching) for n in num_blocks]
        for pool in self.pools:
            (null,) = pool.allocate(1)
            assert null.block_id == NULL_BLOCK_ID
        self._reqs: dict[str, list[_Table]] = {}
        # request id -> (tokens, per group: the cached blocks of the hit's needed range)
        self._pinned: dict[str, tuple[int, list[list[KVCacheBlock]]]] = {}
        # (seq after which the blocks may be freed, group, blocks)
        self._deferred: deque[tuple[int, int, list[KVCacheBlock]]] = deque()

    # -- queries -------------------------------------------------------------------------
    def views(self, request_id: str) -> tuple[array, ...]:
        """Each group's table of the request (read-only 'i' arrays, as group 0's view)."""
        tables = self._reqs.get(request_id)
        if tables is None:
            return tuple(array("i") for _ in self.pools)
        return tuple(t.block_ids for t in tables)

    def num_held_blocks(self, request_id: str) -> tuple[int, ...]:
        """Blocks the request holds in each group (NULL entries not counted)."""
        tables = self._reqs.get(request_id, [])
        return tuple(sum(1 for b in t.blocks if b is not None) for t in tables)

    @property
    def num_used_blocks(self) -> tuple[int, ...]:
        """Blocks in use per group, the null block not counted (0 once every request is freed)."""
        return tuple(p.num_used_blocks - 1 for p in self.pools)

    @property
    def num_total_blocks(self) -> tuple[int, ...]:
        """Blocks each group's pool can hand out (its null block not counted)."""
        return tuple(p.num_blocks - 1 for p in self.pools)

    @property
    def num_deferred_blocks(self) -> int:
        return sum(len(b) for _, _, b in self._deferred)

    def cached_flags(self, block_hashes: Sequence[bytes]) -> list[list[bool]]:
        """Per group: whether each of these blocks is in its prefix cache."""
        return [[p.cached_block(h) is not None for h in block_hashes] for p in self.pools]

    # -- prefix hits ---------------------------------------------------------------------
    def pin_hit(self, request_id: str, block_hashes: Sequence[bytes], num_tokens: int) -> None:
        """Remember the blocks that answered a hit of ``num_tokens`` (the coordinator's rounding
        found them cached): the allocation that follows takes exactly these."""
        hit = []
        for m, pool in zip(self.managers, self.pools, strict=True):
            n = num_tokens // m.block_size
            blocks = []
            for i in range(m.first_needed_block(num_tokens), n):
                blk = pool.cached_block(block_hashes[i])
                assert blk is not None, "the coordinator's hit includes a block this group lacks"
                blocks.append(blk)
            hit.append(blocks)
        self._pinned[request_id] = (num_tokens, hit)

    # -- allocation ----------------------------------------------------------------------
    def _plan(
        self, request_id: str, start: int, total: int, num_hit: int
    ) -> list[tuple[int, int, int]] | None:
        """Per group (first needed block, table entries before the new blocks, new blocks), or
        None when a pool is short. ``start``: the first position computed next (after a hit)."""
        tables = self._reqs.get(request_id)
        pinned = self._pinned.get(request_id) if num_hit else None
        assert not num_hit or (pinned is not None and pinned[0] == num_hit), "a hit without its pin"
        plan = []
        for g, (m, pool) in enumerate(zip(self.managers, self.pools, strict=True)):
            first = m.first_needed_block(start)
            end = -(-total // m.block_size)
            hits = pinned[1][g] if pinned is not None else []
            have = num_hit // m.block_size if pinned is not None else len(tables[g].blocks) if tables else 0
            new = max(0, end - max(first, have))  # positions [max(first, have), end): fresh blocks
            if new > pool.num_free_blocks - sum(1 for b in hits if b.ref_cnt == 0):
                return None
            plan.append((first, have, new))
        return plan

    def can_allocate(self, request_id: str, start: int, total: int, num_hit: int) -> bool:
        return self._plan(request_id, start, total, num_hit) is not None

    def allocate(
        self, request_id: str, start: int, total: int, num_hit: int
    ) -> list[tuple[int, list[KVCacheBlock]]]:
        """Make each group's table cover ``total`` positions, holding blocks from the window's
        first needed block for a chunk starting at ``start``; returns (group, blocks) the window
        no longer sees, for the caller to free behind its fence. Checked by ``can_allocate``."""
        plan = self._plan(request_id, start, total, num_hit)
        assert plan is not None, "GroupTables.allocate without can_allocate"
        pinned = self._pinned.pop(request_id, None) if num_hit else None
        tables = self._reqs.setdefault(request_id, [_Table() for _ in self.pools])
        released = []
        for g, (first, have, new) in enumerate(plan):
            t, pool = tables[g], self.pools[g]
            if pinned is not None:
                hits = pinned[1][g]
                assert not t.blocks, "a pinned hit is for a fresh table"
                assert all(b.block_hash is not None for b in hits), "a pinned block was evicted"
                pool.touch(hits)
                pad = have - len(hits)  # the hit's blocks before its window: NULL
                t.blocks.extend([None] * pad)
                t.blocks.extend(hits)
                t.block_ids.extend([NULL_BLOCK_ID] * pad)
                t.block_ids.extend(b.block_id for b in hits)
                t.first_held = pad
            elif len(t.blocks) < first:  # blocks the window skips entirely (a long chunk)
                gap = first - len(t.blocks)
                t.blocks.extend([None] * gap)
                t.block_ids.extend([NULL_BLOCK_ID] * gap)
            gone = self._release(t, first)
            if gone:
                released.append((g, gone))
            if new:
                blocks = pool.allocate(new)
                t.blocks.extend(blocks)
                t.block_ids.extend(b.block_id for b in blocks)
        return released

    def release(self, request_id: str, start: int) -> list[tuple[int, list[KVCacheBlock]]]:
        """The blocks the windows no longer need for a chunk starting at ``start`` (the decode
        step that needs no new block), taken out of the tables."""
        tables = self._reqs.get(request_id)
        if tables is None:
            return []
        out = []
        for g, (m, t) in enumerate(zip(self.managers, tables, strict=True)):
            gone = self._release(t, m.first_needed_block(start))
            if gone:
                out.append((g, gone))
        return out

    @staticmethod
    def _release(t: _Table, first: int) -> list[KVCacheBlock]:
        gone: list[KVCacheBlock] = []
        first = min(first, len(t.blocks))
        for i in range(t.first_held, first):
            blk = t.blocks[i]
            if blk is not None:
                gone.append(blk)
                t.blocks[i] = None
                t.block_ids[i] = NULL_BLOCK_ID
        t.first_held = max(t.first_held, first)
        return gone

    def cache(self, request_id: str, block_hashes: Sequence[bytes], num_done_blocks: int) -> None:
        """Register each group's held blocks among the first ``num_done_blocks`` (full and
        computed) in its prefix cache (a block already there is skipped by the pool)."""
        tables = self._reqs.get(request_id)
        if tables is None:
            return
        for t, pool in zip(tables, self.pools, strict=True):
            for i in range(t.first_held, min(num_done_blocks, len(t.blocks), len(block_hashes))):
                blk = t.blocks[i]
                if blk is not None and blk.block_hash is None:
                    pool.cache_block(blk, block_hashes[i], block_hashes[i - 1] if i else None)

    def trim(self, request_id: str, keep_blocks: int) -> list[tuple[int, list[KVCacheBlock]]]:
        """Entries past ``keep_blocks`` taken out of the tables (rejected draft slots)."""
        tables = self._reqs.get(request_id)
        out = []
        for g, t in enumerate(tables or []):
            extra = [b for b in t.blocks[keep_blocks:] if b is not None]
            del t.blocks[keep_blocks:]
            del t.block_ids[keep_blocks:]
            t.first_held = min(t.first_held, keep_blocks)
            if extra:
                extra.reverse()
                out.append((g, extra))
        return out

    def take(self, request_id: str) -> list[tuple[int, list[KVCacheBlock]]]:
        """Every block the request holds, its tables dropped (tail blocks first)."""
        self._pinned.pop(request_id, None)
        tables = self._reqs.pop(request_id, [])
        return [(g, [b for b in reversed(t.blocks) if b is not None]) for g, t in enumerate(tables)]

    def drop_pin(self, request_id: str) -> None:
        self._pinned.pop(request_id, None)

    # -- freeing -------------------------------------------------------------------------
    def free(self, groups: list[tuple[int, list[KVCacheBlock]]], after_seq: int, completed_seq: int) -> None:
        """Free now if no step after ``completed_seq`` writes them, else once the fence passed."""
        for g, blocks in groups:
            if after_seq <= completed_seq:
                self.pools[g].free(blocks)
            else:
                self._deferred.append((after_seq, g, blocks))

    def process_deferred(self, completed_seq: int) -> int:
        n = 0
        keep: deque[tuple[int, int, list[KVCacheBlock]]] = deque()
        for seq, g, blocks in self._deferred:
            if seq <= completed_seq:
                self.pools[g].free(blocks)
                n += len(blocks)
            else:
                keep.append((seq, g, blocks))
        self._deferred = keep
        return n
