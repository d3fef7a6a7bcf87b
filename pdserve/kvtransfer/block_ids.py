"""Block id lists as one int64 array plus what a descriptor plan checks of them (``BlockIds``).

A push checks its block ids (in range, the receiver's distinct) and splits them into runs of
consecutive blocks; all of that follows from the lowest and highest id, whether the ids increase
and whether they step by one. ``BlockIds.of`` finds those once with a few numpy calls (no Python
loop over blocks); a producer keeps the held blocks' ``BlockIds`` for every push of the
transfer (``KVSendTracker.held_ids``) and a push takes a prefix of it (``head``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pdserve.errors import PdserveError

_MIN = np.minimum.reduce  # ndarray.min() without its Python wrapper


class BlockIdError(PdserveError, ValueError):
    """A block id list is out of range, has duplicates, or does not pair up with its peer list."""


def as_id_array(block_ids: Sequence[int] | np.ndarray, what: str) -> np.ndarray:
    """Block ids as an int64 array (a ``range`` without a Python loop)."""
    if isinstance(block_ids, range):
        return np.arange(block_ids.start, block_ids.stop, block_ids.step, dtype=np.int64)
    try:
        return np.asarray(block_ids, dtype=np.int64).reshape(-1)
    except OverflowError:
        raise BlockIdError(f"{what}: a block id is outside int64: {list(block_ids)}") from None


# Ids 0 .. n-1 as a list and a tuple (the same int objects), grown on demand up to
# _RUN_CACHE_MAX ids (~4 MiB at most: a KV pool's ids): a run of ids is compared against a slice
# of them (a copy of pointers), not against ints made for it (1,000 ids: 13 us, not 31).
_RUN_CACHE_MAX = 1 << 17
_runs: tuple[list[int], tuple[int, ...]] = ([], ())


def steps_by_one(ids: Sequence[int]) -> bool:
    """``ids[i] == ids[0] + i`` for every i, as one C-level compare (a non-empty list or tuple)."""
    global _runs
    first, k = ids[0], len(ids)
    end = first + k
    run_list, run_tuple = _runs
    if 0 <= first and len(run_list) < end <= _RUN_CACHE_MAX:  # grown by another thread: no matter
        run_list = list(range(min(_RUN_CACHE_MAX, max(end, 2 * len(run_list), 4096))))
        run_tuple = tuple(run_list)
        _runs = (run_list, run_tuple)
    if 0 <= first and end <= len(run_list):
        return ids == (run_list[first:end] if isinstance(ids, list) else run_tuple[first:end])
    run = range(first, end)
    return ids == (list(run) if isinstance(ids, list) else tuple(run))


class BlockIds:
    """Block ids (``ids``, int64) with their lowest and highest id, their steps (``ids[i+1] -
    ids[i]``), whether they strictly increase and whether they step by one (one run)."""

    __slots__ = ("_ordered", "consecutive", "hi", "ids", "increasing", "lo", "step")

    def __init__(
        self,
        ids: np.ndarray,
        step: np.ndarray,
        lo: int,
        hi: int,
        increasing: bool,
        consecutive: bool,
        ordered: np.ndarray | None = None,
    ) -> None:
        self.ids, self.step = ids, step
        self.lo, self.hi = lo, hi
        self.increasing, self.consecutive = increasing, consecutive
        self._ordered = ordered  # the ids sorted (ids that do not increase), for first_repeat

    @classmethod
    def of(cls, block_ids: Sequence[int] | np.ndarray | BlockIds, what: str = "block ids") -> BlockIds:
        """The facts of ``block_ids`` (a ``BlockIds`` passes through); BlockIdError for an id
        outside int64."""
        if isinstance(block_ids, BlockIds):
            return block_ids
        if isinstance(block_ids, (list, tuple)) and block_ids:
            # one run (a fresh pool, the common case): told by C-level compares, the array made
            # by arange, not converted id by id
            first, k = block_ids[0], len(block_ids)
            if (
                type(first) is int
                and -(1 << 63) <= first
                and first + k <= 1 << 63
                and block_ids[-1] - first == k - 1  # the ends first
                and steps_by_one(block_ids)
            ):
                ids = np.arange(first, first + k, dtype=np.int64)
                return cls(ids, np.ones(k - 1, dtype=np.int64), first, first + k - 1, True, True)
        return cls.of_array(as_id_array(block_ids, what))

    @classmethod
    def of_array(cls, ids: np.ndarray) -> BlockIds:
        k = len(ids)
        step = ids[1:] - ids[:-1]
        if k < 2:
            lo = hi = int(ids[0]) if k else 0
            return cls(ids, step, lo, hi, True, True)
        if _MIN(step) > 0:  # increasing: the ends are the extremes
            lo, hi = int(ids[0]), int(ids[-1])
            return cls(ids, step, lo, hi, True, hi - lo == k - 1)
        ordered = np.sort(ids)  # the extremes, and what first_repeat looks at
        return cls(ids, step, int(ordered[0]), int(ordered[-1]), False, False, ordered)

    def __len__(self) -> int:
        return len(self.ids)

    def head(self, n: int) -> BlockIds:
        """The first ``n`` ids (``n <= len(self)``); increasing ids keep their facts."""
        if n >= len(self.ids):
            return self
        if self.increasing and n > 0:
            ids = self.ids[:n]
            hi = int(ids[-1])
            return BlockIds(ids, self.step[: n - 1], self.lo, hi, True, hi - self.lo == n - 1)
        return BlockIds.of_array(self.ids[:n])

    def first_repeat(self) -> int | None:
        """An id that occurs twice, or None (increasing ids never repeat)."""
        if self.increasing:
            return None
        ordered = np.sort(self.ids) if self._ordered is None else self._ordered
        same = ordered[1:] == ordered[:-1]
        return int(ordered[int(same.argmax())]) if same.any() else None

    def tolist(self) -> list[int]:
        return self.ids.tolist()  # type: ignore[no-any-return]
