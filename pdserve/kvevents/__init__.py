"""KV events: each node tells the router which prefix blocks its cache holds (docs/architecture.md).

One Redis stream per node, ``pdserve:kv:events:<node>``, on the cluster's ``redis_url``. Each
entry is a batch of events or a snapshot, JSON in its ``data`` field (never pickle)::

    fields    epoch  the node process's epoch (a new one: the node restarted, its cache is empty)
              kind   "batch" | "snapshot"
              data   batch:    {"events": [[seq, type, hash, parent, num_tokens, group, tier], ...],
                                "last_seq": the last seq the node assigned (dropped ones too)}
                     snapshot: {"seq": S, "blocks": [[hash, parent, num_tokens, group, tier], ...]}

    type      stored | removed | all_cleared        hash / parent: hex ("" for none)
    seq       per node process, from 0 (the all_cleared every start publishes), +1 per event
    group     the KV cache group whose block table holds the block: the engine keeps one table that
              every group reads (engine/kv_cache_groups.py), so 0
    tier      "device" (the KV cache), or the offload tier's "cpu" (host entries that answer
              lookups) and "disk" (pdserve/kvoffload/): a block may be stored in several tiers,
              and a "removed" names the tier it left

A consumer that sees a seq jump (events dropped by a full queue or a Redis outage) asks for a
snapshot by pushing to ``pdserve:kv:resync:<node>``; the node answers in its stream with a snapshot
at seq S (its cache after event S), and the consumer goes on from S + 1.
"""

from __future__ import annotations

STREAM_PREFIX = "pdserve:kv:events:"
RESYNC_PREFIX = "pdserve:kv:resync:"
TIER_DEVICE = "device"


def stream_key(node: str) -> str:
    return STREAM_PREFIX + node


def resync_key(node: str) -> str:
    return RESYNC_PREFIX + node
