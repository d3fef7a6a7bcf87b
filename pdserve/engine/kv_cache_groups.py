"""KV cache groups: layers that keep KV in the same shape and by the same rule. No torch.

A group is a set of layers with one block size and one rule for which of a request's blocks it
still needs (vLLM's hybrid allocator's vocabulary):

    kind             blocks a request needs                 a prefix hit of L tokens is usable if
    ---------------  -------------------------------------  ------------------------------------------
    full_attention   all of [0, L)                          every block of [0, L) is cached
    sliding_window   those the window still sees:           the blocks holding positions
                     [num_computed - W + 1, num_computed)   [L - W + 1, L) are cached (older ones
                                                            may be gone)
    short_conv       the inputs of the last K - 1           the blocks holding positions
    (kernel K)       positions (the convolution's state)    [L - K + 1, L) are cached

A hit must end on a block boundary of every group (no group resumes inside a block it does not
hold), so it is rounded down to a multiple of every group's block size; every token a group's
lookup offered that the rounding or another group declined is counted by reason
(``declined_tokens``; the node exports ``pdserve:prefix_cache_declined_tokens_total{reason}``).

``KVCacheCoordinator`` owns every group's geometry (``group_block_sizes``): no other module
computes a group's block size. Whether a group's blocks are positionally stable (block i always
holds positions [i * bs, (i + 1) * bs) for as long as the request holds it) is its manager's
property.

A short-convolution group (LFM2's depthwise causal convolutions of kernel K) keeps its state as
the convolution's inputs per position, paged like KV: the state after position p is exactly the
inputs of positions p - K + 2 .. p, so the group is a window of K tokens, holds at most a few
blocks per request, and a prefix hit resumes it at any block boundary whose last blocks are
cached (the rounding above makes every hit end on one).

Where each group has its own block table (engine/kv_group_tables.py) a sliding-window or
short-convolution group frees the blocks before ``first_needed_block`` as the request advances;
where the groups share one table (``kv_group_tables.tables_off_reason``: kv_offload, TP or PP)
every layer keeps the whole sequence, and a short-convolution group is refused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.errors import ConfigError

FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"
SHORT_CONV = "short_conv"
WINDOWED_KINDS = (SLIDING_WINDOW, SHORT_CONV)  # groups whose sliding_window bounds what they need

# Reasons a looked-up hit is (partly) not used: pdserve:prefix_cache_declined_tokens_total{reason}
DECLINE_ALIGNMENT = "block_alignment"  # the hit is not on every group's block boundary
DECLINE_GROUP_MISS = "group_miss"  # another full-attention group's run of cached blocks is shorter
DECLINE_WINDOW = "window_blocks_missing"  # a sliding-window group lacks blocks its window needs
DECLINE_OFFLOAD = "offload_unreadable"  # an offload-tier block was corrupt or found no host slot
DECLINE_REASONS = (DECLINE_ALIGNMENT, DECLINE_GROUP_MISS, DECLINE_WINDOW, DECLINE_OFFLOAD)


@dataclass(frozen=True)
class KVCacheGroupSpec:
    kind: str  # FULL_ATTENTION | SLIDING_WINDOW | SHORT_CONV
    layer_names: tuple[str, ...]
    block_size: int
    sliding_window: int | None = None  # tokens: the window (SLIDING_WINDOW), the kernel (SHORT_CONV)

    def __post_init__(self) -> None:
        assert self.kind in (FULL_ATTENTION, *WINDOWED_KINDS), self.kind
        assert (self.kind in WINDOWED_KINDS) == (self.sliding_window is not None), self
        if self.block_size <= 0:
            raise ConfigError(f"a KV group's block_size must be > 0, got {self.block_size}")


class GroupManager:
    """One group's rules. Full attention: every block is needed, and stays where it is."""

    positionally_stable = True

    def __init__(self, spec: KVCacheGroupSpec) -> None:
        self.spec = spec
        self.block_size = spec.block_size

    def first_needed_block(self, num_computed_tokens: int) -> int:
        """Blocks before this index are no longer read (they may be freed)."""
        return 0

    def usable(self, num_tokens: int, cached: Sequence[bool]) -> bool:
        """Whether a hit of ``num_tokens`` (a multiple of the block size) can resume here, given
        which of the group's blocks are cached (``cached[i]``: block i)."""
        n = num_tokens // self.block_size
        return len(cached) >= n and all(cached[i] for i in range(self.first_needed_block(num_tokens), n))


class SlidingWindowManager(GroupManager):
    """Only the blocks the window still sees are needed; older ones may be freed, so a block
    index no longer says which positions the request still holds."""

    positionally_stable = False

    def first_needed_block(self, num_computed_tokens: int) -> int:
        window = self.spec.sliding_window
        assert window is not None
        return max(0, num_computed_tokens - window + 1) // self.block_size


def make_group_manager(spec: KVCacheGroupSpec) -> GroupManager:
    return SlidingWindowManager(spec) if spec.kind in WINDOWED_KINDS else GroupManager(spec)


@dataclass
class PrefixHit:
    num_tokens: int  # usable by every group
    offered_tokens: int  # what the longest group lookup offered before rounding and declines


class KVCacheCoordinator:
    """Every group's geometry, the rounding of a prefix hit across groups, the decline counters."""

    def __init__(self, specs: Sequence[KVCacheGroupSpec]) -> None:
        assert specs, "a model has at least one KV group"
        self.managers = [make_group_manager(s) for s in specs]
        self.declined_tokens = dict.fromkeys(DECLINE_REASONS, 0)

    @property
    def group_block_sizes(self) -> tuple[int, ...]:
        return tuple(m.block_size for m in self.managers)

    @property
    def alignment(self) -> int:
        """Tokens every group's blocks end on: the least common multiple of the block sizes."""
        return math.lcm(*self.group_block_sizes)

    def decline(self, reason: str, num_tokens: int) -> None:
        assert reason in self.declined_tokens, reason
        if num_tokens > 0:
            self.declined_tokens[reason] += num_tokens

    def longest_hit(self, cached: Sequence[Sequence[bool]], max_tokens: int) -> PrefixHit:
        """The longest prefix every group can resume from. ``cached[g][i]``: whether group g's
        block i is cached; ``max_tokens``: the most a hit may cover (one token is left to compute).

        Full-attention groups bound the hit by their runs of cached blocks from the start; the
        bound is rounded down to every group's block boundary, then lowered one alignment step
        at a time until each sliding-window group holds the blocks its window needs."""
        assert len(cached) == len(self.managers)
        runs = []
        for m, c in zip(self.managers, cached, strict=True):
            run = 0
            while run < len(c) and c[run]:
                run += 1
            if m.spec.kind == FULL_ATTENTION:
                runs.append(min(run * m.block_size, max_tokens))
        offered = max(runs) if runs else max_tokens
        bound = min(runs) if runs else max_tokens
        self.decline(DECLINE_GROUP_MISS, offered - bound)
        step = self.alignment
        aligned = bound // step * step
        self.decline(DECLINE_ALIGNMENT, bound - aligned)
        length = aligned
        while length > 0 and not all(m.usable(length, c) for m, c in zip(self.managers, cached, strict=True)):
            length -= step
        self.decline(DECLINE_WINDOW, aligned - length)
        return PrefixHit(length, offered)


def groups_of_model(
    layer_names: Sequence[str],
    layer_types: Sequence[str],
    sliding_window: int | None,
    block_size: int,
    conv_kernel_size: int | None = None,
) -> list[KVCacheGroupSpec]:
    """The KV groups of a model's layers (one group for a model without ``layer_types``):
    full attention first, then sliding-window attention, then short convolutions ("conv")."""
    if not layer_types:
        return [KVCacheGroupSpec(FULL_ATTENTION, tuple(layer_names), block_size)]
    assert len(layer_types) == len(layer_names), (layer_types, layer_names)
    full = tuple(n for n, t in zip(layer_names, layer_types, strict=True) if t == "full_attention")
    sliding = tuple(n for n, t in zip(layer_names, layer_types, strict=True) if t == "sliding_attention")
    out = []
    if full:
        out.append(KVCacheGroupSpec(FULL_ATTENTION, full, block_size))
    if sliding:
        out.append(KVCacheGroupSpec(SLIDING_WINDOW, sliding, block_size, sliding_window))
    conv = tuple(n for n, t in zip(layer_names, layer_types, strict=True) if t == "conv")
    if conv:
        assert conv_kernel_size is not None, "conv layers without a kernel size"
        out.append(KVCacheGroupSpec(SHORT_CONV, conv, block_size, conv_kernel_size))
    return out
