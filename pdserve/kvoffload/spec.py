"""What the scheduler tells the worker side to copy in one step (ints only). No torch."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KVOffloadSpec:
    """Copies to make before the step's forward, stores first (a load may target a block evicted
    by a store of the same step)."""

    stores: list[tuple[int, int]] = field(default_factory=list)  # (device block id, host slot)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (device block id, host slot)
    read_s: float = 0.0  # seconds the scheduler side spent bringing these loads to host slots

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads)


@dataclass
class OffloadHit:
    """A lookup's answer, pinned until the blocks are loaded (``commit``) or declined (``cancel``)."""

    slots: list[int]  # host slots holding the hit blocks, in prefix order
    tiers: list[str]  # "cpu" | "disk": where each block was found
    block_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.slots) * self.block_size
