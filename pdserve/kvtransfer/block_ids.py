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
