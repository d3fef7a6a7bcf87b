"""Cache-aware node choice (``router.policy: cache_aware``): the KV a node already holds, from the
prefix index that KV events build (pdserve/kvevents/), against its queue and KV load.

Costs are in prefilled blocks (``block_cost`` each)::

    prefill node   (prompt blocks - blocks it holds) x block_cost + load x load_cost + kv_usage x kv_usage_cost
    decode node    load x load_cost + kv_usage x kv_usage_cost - blocks it holds x block_cost

A decode node that holds a conversation's history (its last turn's prompt and answer) wins the
follow-up, which then prefills there (``PDBackend.prefill_locally``): no prefill leg, no transfer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.engine.block_pool import hash_prompt_blocks
from pdserve.kvevents.consumer import KVEventConsumer
from pdserve.kvevents.index import PrefixIndex

if TYPE_CHECKING:
    from services.router.nodes import NodeHandle


@dataclass(frozen=True)
class CacheAwareWeights:
    block_cost: float = 1.0  # one block a node must prefill (the unit of the others)
    load_cost: float = 8.0  # one sequence on the node (running, waiting or in flight from the router)
    kv_usage_cost: float = 16.0  # the node's KV cache full (usage 1.0)
    # A block only the node's offload tier (cpu / disk) holds counts this much of a device hit:
    # it is copied in instead of prefilled, which is cheaper but not free.
    offload_hit_weight: float = 0.5


class RouteKey(bytes):
    """The prefix-affinity key (the hash of the prompt's leading blocks, as before) carrying every
    full block's hash of the prompt, for the cache-aware choice of both legs. With the prompt's
    token ids, a node of another block size gets the prompt hashed at its own size."""

    block_hashes: Sequence[bytes]
    _ids: Sequence[int]
    block_size: int  # of block_hashes (0: unknown, every node is taken to hash at it)
    salt: bytes  # the engine's extra hash bytes (a LoRA adapter's content hash; b"" for the base model)
    _by_size: dict[int, Sequence[bytes]]

    def __new__(
        cls,
        key: bytes,
        block_hashes: Sequence[bytes],
        prompt_token_ids: Sequence[int] = (),
        block_size: int = 0,
        salt: bytes = b"",
    ) -> RouteKey:
        obj = super().__new__(cls, key)
        obj.block_hashes = block_hashes
        obj._ids = prompt_token_ids
        obj.block_size = block_size
        obj.salt = salt
        obj._by_size = {block_size: block_hashes}
        return obj

    def hashes_for(self, block_size: int) -> Sequence[bytes]:
        """The prompt's block hashes at ``block_size`` (KV events hash at the node's own size)."""
        got = self._by_size.get(block_size)
        if got is None:
            got = self._by_size[block_size] = hash_prompt_blocks(list(self._ids), block_size, self.salt)
        return got


def kv_usage(n: NodeHandle) -> float:
    return n.kv_blocks_used / n.num_blocks_total if n.num_blocks_total else 0.0


def choose(
    nodes: Sequence[NodeHandle], key: RouteKey, index: PrefixIndex, w: CacheAwareWeights
) -> tuple[NodeHandle, int]:
    """The cheapest of ``nodes`` (non-empty) and the prompt blocks it holds (any tier). Among
    equal costs (an idle fleet, a new prompt) the node with the fewest indexed blocks wins, so new
    prefixes spread over the nodes' caches instead of all landing on the first. Blocks are counted
    at each node's block size; an offload-tier block weighs ``offload_hit_weight``."""
    assert nodes
    best: tuple[float, int, int, NodeHandle] | None = None
    for n in nodes:
        hashes, scale = key.block_hashes, 1.0
        if key._ids and n.block_size != key.block_size:  # in blocks of the key's size
            hashes, scale = key.hashes_for(n.block_size), n.block_size / key.block_size
        hit = index.weighted_overlap(n.name, hashes, w.offload_hit_weight)
        held = index.overlap(n.name, hashes)
        base = n.load_estimate * w.load_cost + kv_usage(n) * w.kv_usage_cost
        if n.role == "prefill":
            cost = base + (len(hashes) - hit) * scale * w.block_cost
        else:
            cost = base - hit * scale * w.block_cost
        rank = (cost, index.num_blocks(n.name))
        if best is None or rank < best[:2]:
            best = (cost, rank[1], held, n)
    assert best is not None
    return best[3], best[2]


class KVEventsCollector:
    """The router's /metrics view of its prefix index and KV event stream (cache_aware)."""

    def __init__(self, consumer: KVEventConsumer) -> None:
        self.consumer = consumer

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        c = self.consumer
        blocks = GaugeMetricFamily(
            "pdserve:router_prefix_index_blocks",
            "Prefix blocks the router's index says a node holds",
            labels=["node"],
        )
        for node in c.index.nodes():
            blocks.add_metric([node], c.index.num_blocks(node))
        yield blocks
        yield CounterMetricFamily(
            "pdserve:router_kv_events", "KV events applied to the prefix index", value=c.num_events
        )
        yield CounterMetricFamily(
            "pdserve:router_kv_event_gaps",
            "Seq gaps seen in nodes' KV events (each asks a re-sync)",
            value=c.num_gaps,
        )
        yield CounterMetricFamily(
            "pdserve:router_kv_event_resyncs",
            "Node snapshots applied to the prefix index",
            value=c.num_resyncs,
        )

    def describe(self) -> list[Any]:
        return []
