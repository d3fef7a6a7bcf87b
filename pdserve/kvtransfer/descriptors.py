"""Transfer descriptors of aligned KV regions (``regions``): which byte ranges a push copies.

A descriptor is ``(src_addr, dst_addr, length_bytes)``. They travel as an int64 array [n, 3]
(``DescriptorTable``), built with numpy from the block id lists: for every group of fused
layers and every run of blocks (or every block, where a group does not fill the block stride)
``base + id * stride`` on each side, broadcast [groups, runs]; then sorted and merged where a
range continues the one before it on both ends. No Python loop over blocks: a 125-block push
of a 16-layer model costs tens of microseconds (bench/kv_plan.py). Backends take the table or
a list of tuples (``descriptor_list`` for engines that want Python ints).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeAlias

import numpy as np

from pdserve.kvtransfer.block_ids import BlockIdError, BlockIds, as_id_array, steps_by_one

if TYPE_CHECKING:
    from pdserve.kvtransfer.regions import Region

# Mooncake's batch calls take at most this many descriptors; 2,049 returns -1 and moves nothing.
MAX_DESCRIPTORS_PER_BATCH = 2048

# (src_addr, dst_addr, length_bytes)
Descriptor = tuple[int, int, int]
# Descriptors as rows of an int64 array [n, 3]: what plans return and cuda_ipc copies from
DescriptorTable: TypeAlias = np.ndarray
# What a backend's write takes: either form
Descriptors: TypeAlias = Sequence[Descriptor] | np.ndarray
# [lowest start, highest end) of the descriptors' sources, then of their targets
Spans: TypeAlias = tuple[int, int, int, int]


_LISTS = (list, tuple)
# Either side of a push: a list of ids, an int64 array, or ids whose facts are known (BlockIds)
BlockIdsLike: TypeAlias = Sequence[int] | np.ndarray | BlockIds


def _one_run_start(ids: BlockIdsLike) -> int | None:
    """The first id where ``ids`` are one run of consecutive ids from an id >= 0 (decided by
    C-level compares of a list, or the facts of a ``BlockIds``), else None."""
    if isinstance(ids, BlockIds):
        return ids.lo if len(ids) and ids.consecutive and ids.lo >= 0 else None
    if not (isinstance(ids, _LISTS) and ids):
        return None
    first = ids[0]
    if not (0 <= first and ids[-1] - first == len(ids) - 1 and steps_by_one(ids)):  # the ends first
        return None
    return int(first)


def check_block_ids(
    block_ids: Sequence[int] | np.ndarray, num_blocks: int | None, *, what: str = "block ids"
) -> None:
    """Raise BlockIdError unless every id is in ``[0, num_blocks)`` (only ``>= 0`` when num_blocks is None)."""
    ids = as_id_array(block_ids, what)
    bad = ids < 0 if num_blocks is None else (ids < 0) | (ids >= num_blocks)
    if bad.any():
        bound = "" if num_blocks is None else f", {num_blocks}"
        raise BlockIdError(f"{what}: block id {int(ids[int(bad.argmax())])} is outside [0{bound})")


class DescriptorPlan:
    """The per-(sender, receiver) part of ``build_descriptors``, done once: layers fused into
    groups (side by side on both ends with equal strides: per block one range) and the block
    bounds. ``descriptors()`` then costs a few numpy calls over the block ids (a producer reuses
    the plan for every push to the same decode layout)."""

    def __init__(self, pairs: Sequence[tuple[Region, Region]]) -> None:
        self.pairs = list(pairs)
        groups: list[
            tuple[int, int, int, int, int]
        ] = []  # (src_base, dst_base, src_stride, dst_stride, nbytes)
        for s, d in sorted(self.pairs, key=lambda p: p[0].base_addr):
            if groups:
                sb, db, ss, ds, n = groups[-1]
                if (ss, ds) == (s.block_stride_bytes, d.block_stride_bytes) and (sb + n, db + n) == (
                    s.base_addr,
                    d.base_addr,
                ):
                    groups[-1] = (sb, db, ss, ds, n + s.block_bytes)
                    continue
            groups.append(
                (s.base_addr, d.base_addr, s.block_stride_bytes, d.block_stride_bytes, s.block_bytes)
            )
        self.groups = groups
        self.bytes_per_block = sum(x[4] for x in groups)  # what one block pair moves in all
        # groups of one stride per side: (strides, (lowest base, highest end) on each side)
        self._one_stride = (
            (
                (groups[0][2], groups[0][3]),
                (
                    min(x[0] for x in groups),
                    max(x[0] + x[4] for x in groups),
                    min(x[1] for x in groups),
                    max(x[1] + x[4] for x in groups),
                ),
            )
            if groups and len({(x[2], x[3]) for x in groups}) == 1
            else None
        )
        g = np.array(groups, dtype=np.int64).reshape(-1, 5)
        whole = (g[:, 2] == g[:, 4]) & (g[:, 3] == g[:, 4])
        # Per set of groups: columns [G, 1] of (src base, dst base, src stride, dst stride,
        # bytes); the groups that fill the block stride on both ends take a row per run of
        # blocks, the others a row per block. Rows of group g: base + id * stride.
        self._sets: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, bool]] = [
            (g[sel, 0:1], g[sel, 1:2], g[sel, 2:3], g[sel, 3:4], g[sel, 4:5], per_run)
            for sel, per_run in ((whole, True), (~whole, False))
            if sel.any()
        ]
        self._per_run = bool(groups) and bool(whole.all())  # every group takes a run per row
        # one such group: rows in increasing source order never merge (they would be one run)
        self._runs_only = len(groups) == 1 and self._per_run
        # a range of block b ends at or below reach + b * stride (kept below 2**63: int64 rows)
        self._reach = [max((x[i] + x[4] for x in groups), default=0) for i in (0, 1)]
        self._stride = [max((x[i + 2] for x in groups), default=0) for i in (0, 1)]
        s_lim = [s.num_blocks for s, _ in self.pairs if s.num_blocks is not None]
        d_lim = [d.num_blocks for _, d in self.pairs if d.num_blocks is not None]
        self._src_limit = min(s_lim) if s_lim else None
        self._dst_limit = min(d_lim) if d_lim else None

    def check(self, src_block_ids: BlockIdsLike, dst_block_ids: BlockIdsLike) -> tuple[BlockIds, BlockIds]:
        """Both id lists as ``BlockIds``; BlockIdError where they do not pair up (lengths,
        receiver ids that repeat) or an id lies outside a layer's blocks."""
        if len(src_block_ids) != len(dst_block_ids):
            raise BlockIdError(
                f"sender has {len(src_block_ids)} block ids but receiver has {len(dst_block_ids)}; they pair 1:1"
            )
        s, d = BlockIds.of(src_block_ids, "sender"), BlockIds.of(dst_block_ids, "receiver")
        if d.first_repeat() is not None:
            raise BlockIdError(f"receiver block ids repeat (two writes to one block): {d.tolist()}")
        if not len(s) or not self.pairs:
            return s, d
        # The id lists are the same for every layer, so their extremes decide; the per-layer scan
        # (which names the layer and the id) runs only when they fail.
        if s.lo < 0 or (self._src_limit is not None and s.hi >= self._src_limit):
            for r, _ in self.pairs:
                check_block_ids(s.ids, r.num_blocks, what=f"sender layer {r.layer_name!r}")
        if d.lo < 0 or (self._dst_limit is not None and d.hi >= self._dst_limit):
            for _, r in self.pairs:
                check_block_ids(d.ids, r.num_blocks, what=f"receiver layer {r.layer_name!r}")
        for side, hi in ((0, s.hi), (1, d.hi)):
            if self._reach[side] + hi * self._stride[side] >= 1 << 63:
                raise BlockIdError(f"{('sender', 'receiver')[side]} block id {hi} lies past 2**63 bytes")
        return s, d

    def _one_run(self, src: BlockIdsLike, dst: BlockIdsLike) -> tuple[DescriptorTable, Spans] | None:
        """The rows of one run of blocks on both ends (a fresh pool on both, the common case)
        from C-level list compares or known facts, without arrays of ids; None where that is not
        the case, the groups take a row per block, or an id needs ``check`` (which raises)."""
        if not self._per_run or len(src) != len(dst):
            return None
        s0, d0 = _one_run_start(src), _one_run_start(dst)
        if s0 is None or d0 is None:
            return None
        k = len(src)
        for end, limit, reach, stride in zip(
            (s0 + k, d0 + k), (self._src_limit, self._dst_limit), self._reach, self._stride, strict=True
        ):
            if (limit is not None and end > limit) or reach + end * stride >= 1 << 63:
                return None
        rows = np.array(
            [(sb + s0 * ss, db + d0 * ds, n * k) for sb, db, ss, ds, n in self.groups], dtype=np.int64
        )
        spans = self._spans(s0, s0 + k - 1, d0, d0 + k - 1)
        return (rows if len(rows) == 1 else merge_adjacent(rows)), spans

    def _spans(self, s_lo: int, s_hi: int, d_lo: int, d_hi: int) -> Spans:
        """The rows' spans from the extreme ids: block b of group g spans ``[base + b * stride,
        base + b * stride + bytes)`` on each side."""
        if self._one_stride is not None:  # one stride per side (a fused tensor, K/V apart)
            (ss, ds), (sb, s_end, db, d_end) = self._one_stride
            return sb + s_lo * ss, s_end + s_hi * ss, db + d_lo * ds, d_end + d_hi * ds
        g = self.groups
        return (
            min(x[0] + s_lo * x[2] for x in g),
            max(x[0] + s_hi * x[2] + x[4] for x in g),
            min(x[1] + d_lo * x[3] for x in g),
            max(x[1] + d_hi * x[3] + x[4] for x in g),
        )

    def descriptors(self, src_block_ids: BlockIdsLike, dst_block_ids: BlockIdsLike) -> DescriptorTable:
        """Rows (src_addr, dst_addr, length_bytes) copying ``src_block_ids[i]`` to
        ``dst_block_ids[i]`` in every region pair, sorted and merged (``merge_adjacent``)."""
        return self.descriptors_spans(src_block_ids, dst_block_ids)[0]

    def descriptors_spans(
        self, src_block_ids: BlockIdsLike, dst_block_ids: BlockIdsLike
    ) -> tuple[DescriptorTable, Spans | None]:
        """``descriptors`` and the rows' spans (``Spans``: what a backend checks against its
        registered memory) from the ids' extremes, without a pass over the rows; None for no rows."""
        one = self._one_run(src_block_ids, dst_block_ids)
        if one is not None:
            return one
        s, d = self.check(src_block_ids, dst_block_ids)
        k = len(s)
        if not k or not self._sets:
            return np.empty((0, 3), dtype=np.int64), None
        spans = self._spans(s.lo, s.hi, d.lo, d.hi)
        # Runs of blocks consecutive on both ends, in the given order: first ids on each side,
        # blocks per run. A block ends a run where either side does not step by one.
        counts: np.ndarray | None = None  # blocks per run; None: one each
        if s.consecutive and d.consecutive:  # one run (a fresh pool on both ends)
            run_s, run_d, counts = s.ids[:1], d.ids[:1], np.full(1, k, dtype=np.int64)
        else:
            if s.consecutive or d.consecutive:
                breaks = (d.step if s.consecutive else s.step) != 1
            else:
                breaks = (s.step != 1) | (d.step != 1)
            (ends,) = np.nonzero(breaks)
            if len(ends) == k - 1:  # every block its own run (scattered): rows as for single blocks
                run_s, run_d = s.ids, d.ids
            else:
                starts = np.empty(len(ends) + 1, dtype=np.int64)
                starts[0] = 0
                np.add(ends, 1, out=starts[1:])
                counts = np.empty_like(starts)
                np.subtract(starts[1:], starts[:-1], out=counts[:-1])
                counts[-1] = k - starts[-1]
                run_s, run_d = s.ids[starts], d.ids[starts]
        # rows straight into the table: [G, runs (or blocks), 3] per set of groups, set after set
        sizes = [len(n) * (len(run_s) if per_run else k) for *_, n, per_run in self._sets]
        table = np.empty((sum(sizes), 3), dtype=np.int64)
        at = 0
        for (sb, db, ss, ds, n, per_run), size in zip(self._sets, sizes, strict=True):
            rows = table[at : at + size].reshape(len(n), -1, 3)
            for col, ids, base, stride in ((0, run_s, sb, ss), (1, run_d, db, ds)):
                out = rows[:, :, col]
                np.multiply(ids if per_run else (s.ids, d.ids)[col], stride, out=out)
                out += base
            if per_run and counts is not None:
                np.multiply(n, counts, out=rows[:, :, 2])
            else:
                rows[:, :, 2] = n
            at += size
        if self._runs_only and (s.increasing or (run_s[1:] > run_s[:-1]).all()):
            return table, spans  # one group, rows in increasing source order: nothing to merge
        return merge_adjacent_columns(table[:, 0], table[:, 1], table[:, 2]), spans


def descriptor_table(descs: Descriptors) -> DescriptorTable:
    """Descriptors as an int64 array [n, 3] (src, dst, bytes); an int64 array passes through."""
    if isinstance(descs, np.ndarray):
        return descs.astype(np.int64, copy=False).reshape(-1, 3)
    return np.fromiter(itertools.chain.from_iterable(descs), np.int64, 3 * len(descs)).reshape(-1, 3)


def descriptor_list(descs: Descriptors) -> list[Descriptor]:
    """Descriptors as ``(src, dst, bytes)`` tuples of Python ints, for engines that take lists."""
    if isinstance(descs, np.ndarray):
        return [(s, d, n) for s, d, n in descs.tolist()]
    return list(descs)


def merge_adjacent(raw: Descriptors) -> DescriptorTable:
    """``raw`` sorted (by source, then target, then length), with ranges contiguous on both
    ends merged into one: a row merges into the one before it when its source and its target
    both start where that row ends."""
    t = descriptor_table(raw)
    return t.copy() if len(t) < 2 else merge_adjacent_columns(t[:, 0], t[:, 1], t[:, 2])


def merge_adjacent_columns(src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> DescriptorTable:
    """``merge_adjacent`` of the rows given as three int64 columns of equal length (>= 2)."""
    if not (src[1:] > src[:-1]).all():  # not already sorted by a unique source
        order = np.argsort(src, kind="stable")
        if (np.diff(src[order]) == 0).any():  # rows sharing a source: by target, then length
            order = np.lexsort((lengths, dst, src))
        src, dst, lengths = src[order], dst[order], lengths[order]
    joins = (src[1:] == src[:-1] + lengths[:-1]) & (dst[1:] == dst[:-1] + lengths[:-1])
    if joins.any():
        first = np.empty(len(src), dtype=bool)  # the rows that start a merged range
        first[0] = True
        np.logical_not(joins, out=first[1:])
        starts = np.flatnonzero(first)
        src, dst, lengths = src[starts], dst[starts], np.add.reduceat(lengths, starts)
    return np.stack((src, dst, lengths), axis=1)


def split_batches(
    descs: Descriptors, max_per_batch: int = MAX_DESCRIPTORS_PER_BATCH
) -> list[list[Descriptor]]:
    """Chunk descriptors into batches the engine accepts (at most ``max_per_batch`` each)."""
    if max_per_batch <= 0:
        raise ValueError(f"max_per_batch must be > 0, got {max_per_batch}")
    rows = descriptor_list(descs)
    return [rows[i : i + max_per_batch] for i in range(0, len(rows), max_per_batch)]
