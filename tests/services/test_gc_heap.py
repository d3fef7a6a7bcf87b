"""services/gc_heap.py: the start-up heap leaves the collector's generations; garbage does not."""

from __future__ import annotations

import gc

from services.gc_heap import freeze_startup_heap


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_startup_objects_leave_every_later_collection_and_garbage_is_collected_first() -> None:
    assert gc.get_freeze_count() == 0, "another test left objects frozen"
    kept = [[i] for i in range(20_000)]  # tracked (lists always are) and alive: the start-up heap
    garbage = _Cycle()
    del garbage  # unreachable only through its cycle: a collection frees it
    try:
        frozen = freeze_startup_heap("test")
        # a frozen object freed since (another thread of the test process) lowers the count
        assert frozen >= gc.get_freeze_count() >= len(kept)
        # what a full collection walks now: only objects made after the freeze (other threads of a
        # long test process make some), not the hundreds of thousands frozen
        assert len(gc.get_objects()) < 10_000 < len(kept)
        assert not any(isinstance(o, _Cycle) for o in gc.get_objects())
        assert gc.is_tracked(kept[0]) and kept[0] == [0]
    finally:
        gc.unfreeze()  # the test process's heap back to the oldest generation
    assert gc.get_freeze_count() == 0
    assert not any(isinstance(o, _Cycle) for o in gc.get_objects())  # it was collected, not frozen
