"""Ref-counted KV blocks with prefix caching (chained block hashes) and LRU eviction.

Ints and ids only: no torch (the scheduler's tests run in milliseconds).

Life of a block:

    free (uncached) --allocate--> in use (ref_cnt >= 1) --free--> free, still cached (hash kept)
         ^                                                             |
         +------------------- evicted by allocate (LRU) ---------------+
    a cached free block can also be revived by a prefix hit (touch), without eviction.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

NONE_HASH = b"\x00" * 16


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """Chained hash of one full block: depends on every token before it, stable across processes.

    The router computes the same hashes for prefix affinity, so this must not use Python's hash().
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash or NONE_HASH)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(extra)
    return h.digest()


def hash_prompt_blocks(token_ids: Sequence[int], block_size: int, extra: bytes = b"") -> list[bytes]:
    """Hashes of every full block of ``token_ids``."""
    out: list[bytes] = []
    parent: bytes | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra)
        out.append(parent)
    return out


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set while the block holds a full, hashed block of tokens


class BlockEventListener(Protocol):
    """Told of prefix-cache changes on the engine thread (pdserve/kvevents/): must not block."""

    def block_stored(self, block_hash: bytes, parent_hash: bytes | None) -> None: ...
    def block_removed(self, block_hash: bytes) -> None: ...


class BlockPool:
    """Owns every block; hands them out and takes them back.

    Mutates: ``blocks`` ref counts, the free queue (LRU order, oldest first) and the hash map.
    Callers (the KV cache manager) own the list of blocks each request holds.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # Blocks come into being on first use: a tiny model on a large GPU has millions of blocks,
        # and building them all up front took seconds and GBs of host memory per engine.
        # Never-used blocks are the ids [_fresh, num_blocks); they are handed out first, in id
        # order, before any freed one (as if they stood at the head of the free queue).
        self.blocks: dict[int, KVCacheBlock] = {}
        self._fresh = 0
        # Every used-before block with ref_cnt == 0, least recently freed first (evicted first).
        self._free: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[bytes, KVCacheBlock] = {}
        # Counters for metrics: prefix-cache lookups in blocks.
        self.num_queried_blocks = 0
        self.num_hit_blocks = 0
        self.num_evicted_blocks = 0
        self.listener: BlockEventListener | None = None  # set by the node (KV events)
        # Called with (block_id, block_hash) when a cached block is evicted for reuse, before it
        # is handed out (the KV offload tier copies it out: pdserve/kvoffload/manager.py).
        self.on_evict: Callable[[int, bytes], None] | None = None

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + self.num_blocks - self._fresh

    @property
    def num_used_blocks(self) -> int:
        return self._fresh - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def hit_rate(self) -> float:
        return self.num_hit_blocks / self.num_queried_blocks if self.num_queried_blocks else 0.0

    def lookup(self, block_hashes: Sequence[bytes]) -> list[KVCacheBlock]:
        """Longest run of cached blocks matching ``block_hashes`` from the start (does not touch)."""
        hits: list[KVCacheBlock] = []
        if not self.enable_caching:
            return hits
        for h in block_hashes:
            blk = self._cached.get(h)
            if blk is None:
                break
            hits.append(blk)
        return hits

    def cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        """The block cached under ``block_hash``, if any (does not touch)."""
        return self._cached.get(block_hash) if self.enable_caching else None

    def record_lookup(self, num_queried: int, num_hit: int) -> None:
        self.num_queried_blocks += num_queried
        self.num_hit_blocks += num_hit

    # -- mutation ------------------------------------------------------------------------
    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on (possibly free, cached) blocks: a prefix hit."""
        for blk in blocks:
            if blk.ref_cnt == 0:
                del self._free[blk.block_id]
            blk.ref_cnt += 1

    def allocate(self, n: int) -> list[KVCacheBlock]:
        """Pop ``n`` free blocks (evicting cached ones LRU-first). Caller checked ``num_free_blocks``."""
        assert n <= self.num_free_blocks, f"allocate({n}) with {self.num_free_blocks} free"
        out: list[KVCacheBlock] = []
        fresh = min(n, self.num_blocks - self._fresh)
        for block_id in range(self._fresh, self._fresh + fresh):
            blk = KVCacheBlock(block_id, ref_cnt=1)
            self.blocks[block_id] = blk
            out.append(blk)
        self._fresh += fresh
        for _ in range(n - fresh):
            block_id, _ = self._free.popitem(last=False)
            blk = self.blocks[block_id]
            if blk.block_hash is not None:
                if self.on_evict is not None:
                    self.on_evict(block_id, blk.block_hash)
                del self._cached[blk.block_hash]
                if self.listener is not None:
                    self.listener.block_removed(blk.block_hash)
                blk.block_hash = None
                self.num_evicted_blocks += 1
            assert blk.ref_cnt == 0
            blk.ref_cnt = 1
            out.append(blk)
        return out

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the free queue's tail (evicted last).

        Pass a request's blocks in reverse order so its tail blocks are evicted before its
        prefix, which other requests are more likely to share.
        """
        for blk in blocks:
            assert blk.ref_cnt > 0, f"double free of block {blk.block_id}"
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                self._free[blk.block_id] = None

    def cache_block(self, blk: KVCacheBlock, block_hash: bytes, parent_hash: bytes | None = None) -> None:
        """Register a full block under its hash (first writer wins; duplicates stay uncached)."""
        if not self.enable_caching or blk.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        blk.block_hash = block_hash
        self._cached[block_hash] = blk
        if self.listener is not None:
            self.listener.block_stored(block_hash, parent_hash)
