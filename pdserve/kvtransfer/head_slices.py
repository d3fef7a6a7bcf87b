"""Descriptors between TP ranks of different sizes: a KV-head slice of every token row.

One layer's block on a TP rank is ``[2, block_size, H_local, head_dim]`` (K rows, then V rows;
each token row holds the rank's ``H_local = num_kv_heads / tp`` heads side by side). When the
prefill and the decode rank hold the same heads, a block is one range and ``DescriptorPlan``
fuses whole runs of blocks. When they hold different head ranges, the heads they share are one
run per token row:

    prefill tp=2, rank r (1 head)        decode tp=1 (2 heads)
    row t: [h_r]                 ---->   row t: [h0 | h1]  at byte (row * 2 + r) * head_dim * elem

    prefill tp=1 (2 heads)               decode tp=2, rank d (1 head)
    row t: [h0 | h1]             ---->   row t: [h_d]      from byte (row * 2 + d) * head_dim * elem

so a block of one layer costs ``2 * block_size`` descriptors instead of one (rows of one side
are contiguous only when that side's whole row is the shared heads; the other side's are not).
That is ``HeadSlicePlan``, used when the decode rank holds more heads than the prefill rank
(prefill TP 2 -> decode TP 1). When the prefill rank holds all of the decode rank's heads
(prefill TP 1 -> decode TP 2), ``GatherPlan`` packs them first (``staging.Stager``: one torch
gather into a registered buffer in the decode rank's layout) and writes whole runs instead.
numpy, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pdserve.kvtransfer.descriptors import BlockIdsLike
from pdserve.kvtransfer.regions import (
    Descriptor,
    DescriptorPlan,
    Descriptors,
    DescriptorTable,
    Region,
    RegionMismatchError,
    merge_adjacent_columns,
)


@dataclass(frozen=True)
class HeadLayout:
    """What a block of one layer is made of (equal on both sides: the handshake compares it)."""

    block_size: int
    head_dim: int
    elem_bytes: int

    def block_bytes(self, num_heads: int) -> int:
        return 2 * self.block_size * num_heads * self.head_dim * self.elem_bytes


class HeadSlicePlan:
    """``DescriptorPlan``'s interface for a sender holding KV heads ``src_heads`` and a receiver
    holding ``dst_heads`` (``[start, end)`` of the model's KV heads): per block pair and layer,
    one descriptor per token row of K and of V for the heads both hold (none if they share none).
    Region pairs come from ``align_regions(..., same_size=False)``; their sizes are checked here
    against the head counts (RegionMismatchError)."""

    def __init__(
        self,
        pairs: Sequence[tuple[Region, Region]],
        src_heads: tuple[int, int],
        dst_heads: tuple[int, int],
        layout: HeadLayout,
    ) -> None:
        src_n, dst_n = src_heads[1] - src_heads[0], dst_heads[1] - dst_heads[0]
        for r, n in [(s, src_n) for s, _ in pairs] + [(d, dst_n) for _, d in pairs]:
            if r.block_bytes != layout.block_bytes(n):
                raise RegionMismatchError(
                    r.layer_name,
                    r.occurrence,
                    f"block_bytes for {n} KV heads",
                    layout.block_bytes(n),
                    r.block_bytes,
                )
        self.pairs = list(pairs)
        self._bounds = DescriptorPlan(pairs)  # block id checks only (its groups are not used)
        lo, hi = max(src_heads[0], dst_heads[0]), min(src_heads[1], dst_heads[1])
        unit = layout.head_dim * layout.elem_bytes
        # Offsets inside one block of one layer: (src offset, dst offset, bytes) per row.
        rows = 2 * layout.block_size
        self.row_runs: list[Descriptor] = (
            [
                (
                    (row * src_n + lo - src_heads[0]) * unit,
                    (row * dst_n + lo - dst_heads[0]) * unit,
                    (hi - lo) * unit,
                )
                for row in range(rows)
            ]
            if lo < hi
            else []
        )
        self._rows = np.array(self.row_runs, dtype=np.int64).reshape(-1, 3)
        sides = ([s for s, _ in self.pairs], [d for _, d in self.pairs])  # [pair, 1] columns below
        self._bases = [np.array([r.base_addr for r in rs], dtype=np.int64).reshape(-1, 1) for rs in sides]
        self._strides = [
            np.array([r.block_stride_bytes for r in rs], dtype=np.int64).reshape(-1, 1) for rs in sides
        ]

    @property
    def descriptors_per_block(self) -> int:
        """Descriptors one block pair costs over every layer (before merging adjacent ones)."""
        return len(self.row_runs) * len(self.pairs)

    def descriptors(self, src_block_ids: BlockIdsLike, dst_block_ids: BlockIdsLike) -> DescriptorTable:
        ids = tuple(x.ids for x in self._bounds.check(src_block_ids, dst_block_ids))
        if not len(self._rows) or not len(ids[0]) or not self.pairs:
            return np.empty((0, 3), dtype=np.int64)
        # [pair, block, row]: the row's offsets from the block's address on each side
        src, dst = (
            ((base + b * stride)[:, :, None] + self._rows[:, side]).ravel()
            for side, (base, stride, b) in enumerate(zip(self._bases, self._strides, ids, strict=True))
        )
        lengths = np.broadcast_to(self._rows[:, 2], (len(self.pairs), len(ids[0]), len(self._rows))).ravel()
        if len(src) < 2:
            return np.stack((src, dst, lengths), axis=1)
        return merge_adjacent_columns(src, dst, lengths)


@dataclass(frozen=True)
class HeadGather:
    """What a stager packs: these source blocks, local layers ``[lo, hi)``, local heads ``[lo, hi)``."""

    block_ids: tuple[int, ...]
    layers: tuple[int, int]
    heads: tuple[int, int]


class GatherWriter(Protocol):
    """Packs a ``HeadGather`` next to the KV tensor and writes it (``staging.Stager`` in the
    process that owns the tensor; ``StageWriteBackend`` for a worker's)."""

    def write_gathered(
        self, peer_session: str, gather: HeadGather, descs: Descriptors, *, transfer_id: str
    ) -> None: ...


class GatherPlan:
    """Descriptors from a staging buffer (address 0) to the receiver's blocks, and the gather
    that fills the buffer. ``pairs``: aligned (sender, receiver) regions (``align_regions(...,
    same_size=False)``); ``src_regions``: all of the sender's, in local layer order."""

    def __init__(
        self,
        pairs: Sequence[tuple[Region, Region]],
        src_regions: Sequence[Region],
        src_heads: tuple[int, int],
        dst_heads: tuple[int, int],
        layout: HeadLayout,
    ) -> None:
        assert src_heads[0] <= dst_heads[0] and dst_heads[1] <= src_heads[1], (src_heads, dst_heads)
        dst_bytes = layout.block_bytes(dst_heads[1] - dst_heads[0])
        for _, d in pairs:
            if d.block_bytes != dst_bytes:
                raise RegionMismatchError(d.layer_name, d.occurrence, "block_bytes", dst_bytes, d.block_bytes)
        index = {r.key: i for i, r in enumerate(src_regions)}
        local = [index[s.key] for s, _ in pairs]
        self.layers = (min(local), max(local) + 1) if local else (0, 0)
        assert local == list(range(*self.layers)), f"layers sent must be consecutive: {local}"
        n = len(local)
        staged = [
            (Region(s.layer_name, s.occurrence, i * dst_bytes, max(1, n) * dst_bytes, dst_bytes), d)
            for i, (s, d) in enumerate(pairs)
        ]
        self._plan = DescriptorPlan(staged)
        self._bounds = DescriptorPlan(pairs)  # block id checks against the real regions
        self.heads = (dst_heads[0] - src_heads[0], dst_heads[1] - src_heads[0])

    def descriptors(self, src_block_ids: BlockIdsLike, dst_block_ids: BlockIdsLike) -> DescriptorTable:
        """Relative to the staging buffer's start (staged block i holds ``src_block_ids[i]``)."""
        self._bounds.check(src_block_ids, dst_block_ids)
        return self._plan.descriptors(range(len(src_block_ids)), dst_block_ids)

    def gather(self, src_block_ids: Sequence[int]) -> HeadGather:
        return HeadGather(tuple(src_block_ids), self.layers, self.heads)
