"""The router's global prefix index: which nodes hold which prefix blocks (from KV events).

A hash map per node (block hash -> None, insertion order), bounded by ``max_blocks_per_node``:
past it the node's oldest entries go first (the engine's LRU evicts its oldest too). A node's
entries go all at once when it leaves the registry, restarts (a new epoch) or re-syncs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class PrefixIndex:
    """Mutated by the event consumer only; ``overlap`` is read by the router's node choice."""

    def __init__(self, max_blocks_per_node: int = 1 << 20) -> None:
        assert max_blocks_per_node > 0
        self.max_blocks_per_node = max_blocks_per_node
        self._blocks: dict[str, dict[bytes, None]] = {}
        self.num_trimmed = 0  # entries dropped for the bound (the node may still hold them)

    # -- queries -------------------------------------------------------------------------------
    def nodes(self) -> list[str]:
        return sorted(self._blocks)

    def num_blocks(self, node: str) -> int:
        return len(self._blocks.get(node, ()))

    def holds(self, node: str, block_hash: bytes) -> bool:
        return block_hash in self._blocks.get(node, ())

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
    def add(self, node: str, block_hash: bytes) -> None:
        held = self._blocks.setdefault(node, {})
        held.pop(block_hash, None)
        held[block_hash] = None
        if len(held) > self.max_blocks_per_node:
            del held[next(iter(held))]
            self.num_trimmed += 1

    def remove(self, node: str, block_hash: bytes) -> None:
        held = self._blocks.get(node)
        if held is not None:
            held.pop(block_hash, None)

    def clear_node(self, node: str) -> None:
        """The node's cache is empty (all_cleared, a restart): it stays known, with no blocks."""
        self._blocks[node] = {}

    def drop_node(self, node: str) -> None:
        """The node left (its registry entry expired): forget it."""
        self._blocks.pop(node, None)

    def replace_node(self, node: str, block_hashes: Iterable[bytes]) -> None:
        self.clear_node(node)
        for h in block_hashes:
            self.add(node, h)
