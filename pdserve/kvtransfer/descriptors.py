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

from pdserve.errors import PdserveError

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


class BlockIdError(PdserveError, ValueError):
    """A block id list is out of range, has duplicates, or does not pair up with its peer list."""


def _ids(block_ids: Sequence[int] | np.ndarray, what: str) -> np.ndarray:
    """Block ids as an int64 array (a ``range`` without a Python loop)."""
    if isinstance(block_ids, range):
        return np.arange(block_ids.start, block_ids.stop, block_ids.step, dtype=np.int64)
    try:
        return np.asarray(block_ids, dtype=np.int64).reshape(-1)
    except OverflowError:
        raise BlockIdError(f"{what}: a block id is outside int64: {list(block_ids)}") from None


_LISTS = (list, tuple)


def _steps_by_one(ids: Sequence[int]) -> bool:
    """``ids[i] == ids[0] + i`` for every i, as one C-level compare (a list or a tuple)."""
    run = range(ids[0], ids[0] + len(ids))
    return ids == (list(run) if isinstance(ids, list) else tuple(run))


def _id_pairs(src: Sequence[int] | np.ndarray, dst: Sequence[int] | np.ndarray) -> np.ndarray:
    """[2, k] int64: the sender's ids, then the receiver's (one conversion for two lists)."""
    if isinstance(src, _LISTS) and isinstance(dst, _LISTS):
        try:
            return np.array((src, dst), dtype=np.int64).reshape(2, -1)
        except OverflowError:
            pass  # _ids names the side
    return np.stack((_ids(src, "sender"), _ids(dst, "receiver")))


def check_block_ids(
    block_ids: Sequence[int] | np.ndarray, num_blocks: int | None, *, what: str = "block ids"
) -> None:
    """Raise BlockIdError unless every id is in ``[0, num_blocks)`` (only ``>= 0`` when num_blocks is None)."""
    ids = _ids(block_ids, what)
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
        g = np.array(groups, dtype=np.int64).reshape(-1, 5)
        whole = (g[:, 2] == g[:, 4]) & (g[:, 3] == g[:, 4])
        # Per set of groups: bases and strides [G, 1, 2] (src, dst), bytes [G, 1]; the
        # groups that fill the block stride on both ends take a row per run of blocks, the others
        # a row per block. Rows of group g: base + id * stride.
        self._sets = [
            (g[sel][:, None, :2], g[sel][:, None, 2:4], g[sel, 4:5], per_run)
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

    def _check(
        self, src_block_ids: Sequence[int] | np.ndarray, dst_block_ids: Sequence[int] | np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, bool]:
        """The ids as one int64 array [2, k] (sender's, receiver's), its steps along k, and
        whether the sender's ids increase; BlockIdError where they do not pair up or fit."""
        if len(src_block_ids) != len(dst_block_ids):
            raise BlockIdError(
                f"sender has {len(src_block_ids)} block ids but receiver has {len(dst_block_ids)}; they pair 1:1"
            )
        ids = _id_pairs(src_block_ids, dst_block_ids)
        k = ids.shape[1]
        step = ids[:, 1:] - ids[:, :-1]
        s_up, d_up = step.min(axis=1).tolist() if k > 1 else (1, 1)  # > 0: the ids increase
        if d_up > 0:  # increasing ids cannot repeat
            d_lo, d_hi = (int(ids[1, 0]), int(ids[1, -1])) if k else (0, 0)
        else:  # sorted to tell
            ordered = np.sort(ids[1])
            if (ordered[1:] == ordered[:-1]).any():
                raise BlockIdError(
                    f"receiver block ids repeat (two writes to one block): {list(dst_block_ids)}"
                )
            d_lo, d_hi = int(ordered[0]), int(ordered[-1])
        if not k or not self.pairs:
            return ids, step, s_up > 0
        # The id lists are the same for every layer, so their extremes decide; the per-layer scan
        # (which names the layer and the id) runs only when they fail.
        if s_up > 0:
            s_lo, s_hi = int(ids[0, 0]), int(ids[0, -1])
        else:
            s_lo, s_hi = int(ids[0].min()), int(ids[0].max())
        if s_lo < 0 or (self._src_limit is not None and s_hi >= self._src_limit):
            for s, _ in self.pairs:
                check_block_ids(ids[0], s.num_blocks, what=f"sender layer {s.layer_name!r}")
        if d_lo < 0 or (self._dst_limit is not None and d_hi >= self._dst_limit):
            for _, d in self.pairs:
                check_block_ids(ids[1], d.num_blocks, what=f"receiver layer {d.layer_name!r}")
        for side, hi in ((0, s_hi), (1, d_hi)):
            if self._reach[side] + hi * self._stride[side] >= 1 << 63:
                raise BlockIdError(f"{('sender', 'receiver')[side]} block id {hi} lies past 2**63 bytes")
        return ids, step, s_up > 0

    def _one_run(
        self, src: Sequence[int] | np.ndarray, dst: Sequence[int] | np.ndarray
    ) -> DescriptorTable | None:
        """The rows of one run of blocks on both ends (a fresh pool on both, the common case)
        from C-level list compares, without arrays of ids; None where that is not the case,
        the groups take a row per block, or an id needs ``_check`` (which raises)."""
        if not (self._per_run and isinstance(src, _LISTS) and isinstance(dst, _LISTS)):
            return None
        if not src or len(src) != len(dst):
            return None
        k, s0, d0 = len(src), src[0], dst[0]
        if not (0 <= s0 and 0 <= d0 and src[-1] - s0 == k - 1 == dst[-1] - d0):  # the ends first
            return None
        if not (_steps_by_one(src) and _steps_by_one(dst)):
            return None
        for end, limit, reach, stride in zip(
            (s0 + k, d0 + k), (self._src_limit, self._dst_limit), self._reach, self._stride, strict=True
        ):
            if (limit is not None and end > limit) or reach + end * stride >= 1 << 63:
                return None
        rows = np.array(
            [(sb + s0 * ss, db + d0 * ds, n * k) for sb, db, ss, ds, n in self.groups], dtype=np.int64
        )
        return rows if len(rows) == 1 else merge_adjacent(rows)

    def descriptors(
        self, src_block_ids: Sequence[int] | np.ndarray, dst_block_ids: Sequence[int] | np.ndarray
    ) -> DescriptorTable:
        """Rows (src_addr, dst_addr, length_bytes) copying ``src_block_ids[i]`` to
        ``dst_block_ids[i]`` in every region pair, sorted and merged (``merge_adjacent``)."""
        one = self._one_run(src_block_ids, dst_block_ids)
        if one is not None:
            return one
        ids, step, src_up = self._check(src_block_ids, dst_block_ids)
        k = ids.shape[1]
        if not k or not self._sets:
            return np.empty((0, 3), dtype=np.int64)
        # Runs of blocks consecutive on both ends, in the given order: first ids [2, R], lengths
        # [R]. A block ends a run where either side does not step by one.
        ends = np.flatnonzero((step != 1).any(axis=0))
        counts: np.ndarray | None  # blocks per run; None: one each
        if len(ends) == k - 1:  # every block its own run (scattered): rows as for single blocks
            runs, counts = ids, None
        elif len(ends):
            starts = np.empty(len(ends) + 1, dtype=np.int64)
            starts[0] = 0
            np.add(ends, 1, out=starts[1:])
            counts = np.empty_like(starts)
            np.subtract(starts[1:], starts[:-1], out=counts[:-1])
            counts[-1] = k - starts[-1]
            runs = ids[:, starts]
        else:  # one run (a fresh pool on both ends)
            runs, counts = ids[:, :1], np.full(1, k, dtype=np.int64)
        # rows straight into the table: [G, runs (or blocks), 3] per set of groups, set after set
        sizes = [len(n) * (runs.shape[1] if per_run else k) for _, _, n, per_run in self._sets]
        table = np.empty((sum(sizes), 3), dtype=np.int64)
        at = 0
        for (bases, strides, n, per_run), size in zip(self._sets, sizes, strict=True):
            rows = table[at : at + size].reshape(len(n), -1, 3)
            np.multiply((runs if per_run else ids).T, strides, out=rows[:, :, :2])
            rows[:, :, :2] += bases
            if per_run and counts is not None:
                np.multiply(n, counts, out=rows[:, :, 2])
            else:
                rows[:, :, 2] = n
            at += size
        if self._runs_only and (src_up or (runs[0, 1:] > runs[0, :-1]).all()):
            return table  # one group, rows in increasing source order: nothing to merge
        return merge_adjacent_columns(table[:, 0], table[:, 1], table[:, 2])


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
