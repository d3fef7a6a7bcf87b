"""The router's global prefix index: which nodes hold which prefix blocks (from KV events).

A hash map per node (block hash -> the tiers holding it: DEVICE and / or OFFLOAD bits, insertion
order), bounded by ``max_blocks_per_node``:
past it the node's oldest entries go first (the engine's LRU evicts its oldest too). A node's
entries go all at once when it leaves the registry, restarts (a new epoch) or re-syncs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

DEVICE = 1  # the node's KV cache
OFFLOAD = 2  # its offload tier (cpu or disk): a hit there is a copy in, cheaper than a prefill


def tier_bit(tier: str) -> int:
    return DEVICE if tier == "device" else OFFLOAD


class PrefixIndex:
    """Mutated by the event consumer only; ``overlap`` is read by the router's node choice."""

    def __init__(self, max_blocks_per_node: int = 1 << 20) -> None:
        assert max_blocks_per_node > 0
        self.max_blocks_per_node = max_blocks_per_node
        self._blocks: dict[str, dict[bytes, int]] = {}
        self.num_trimmed = 0  # entries dropped for the bound (the node may still hold them)

    # -- queries -------------------------------------------------------------------------------
    def nodes(self) -> list[str]:
        return sorted(self._blocks)

    def num_blocks(self, node: str) -> int:
        return len(self._blocks.get(node, ()))

    def holds(self, node: str, block_hash: bytes) -> bool:
        return block_hash in self._blocks.get(node, ())

    def weighted_overlap(self, node: str, block_hashes: Sequence[bytes], offload_weight: float) -> float:
        """The leading run of ``block_hashes`` the node holds in any tier, a device block counting
        1 and an offload-tier-only block ``offload_weight``."""
        held = self._blocks.get(node)
        if not held:
            return 0.0
        n = 0.0
        for h in block_hashes:
            bits = held.get(h)
            if not bits:
                break
            n += 1.0 if bits & DEVICE else offload_weight
        return n

    def overlap(self, node: str, block_hashes: Sequence[bytes]) -> int:
        """Leading blocks of ``block_hashes`` the node holds (a prefix hit stops at the first miss)."""
        held = self._blocks.get(node)
        if not held:
            return 0
        n = 0
        for h in block_hashes:
            if h not in held:
                break
            n += 1
        return n

    # -- mutation ------------------------------------------------------------------------------
    def add(self, node: str, block_hash: bytes, tier: int = DEVICE) -> None:
        held = self._blocks.setdefault(node, {})
        held[block_hash] = held.pop(block_hash, 0) | tier
        if len(held) > self.max_blocks_per_node:
            del held[next(iter(held))]
            self.num_trimmed += 1

    def remove(self, node: str, block_hash: bytes, tier: int = DEVICE) -> None:
        held = self._blocks.get(node)
        if held is not None and block_hash in held:
            bits = held[block_hash] & ~tier
            if bits:
                held[block_hash] = bits
            else:
                del held[block_hash]

    def clear_node(self, node: str) -> None:
        """The node's cache is empty (all_cleared, a restart): it stays known, with no blocks."""
        self._blocks[node] = {}

    def drop_node(self, node: str) -> None:
        """The node left (its registry entry expired): forget it."""
        self._blocks.pop(node, None)

    def replace_node(self, node: str, blocks: Iterable[tuple[bytes, int]]) -> None:
        """A snapshot: (hash, tier bit) pairs."""
        self.clear_node(node)
        for h, tier in blocks:
            self.add(node, h, tier)
