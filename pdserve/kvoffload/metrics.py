"""The offload tier's Prometheus families, read from its manager at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric

from pdserve.kvoffload.manager import LOAD_SECONDS_BUCKETS, KVOffloadManager


def kv_offload_metrics(mgr: KVOffloadManager, labels: list[str], values: list[str]) -> Iterator[Metric]:
    for name, doc, value in (
        ("kv_offload_stored_blocks", "Evicted KV blocks copied into the offload tier", mgr.num_stored_blocks),
        (
            "kv_offload_dropped_blocks",
            "Evicted KV blocks the offload tier could not take (every host slot pinned by a copy in flight)",
            mgr.num_dropped_blocks,
        ),
        (
            "kv_offload_corrupt_blocks",
            "Disk-tier files that failed their checks (header, length, digest): counted misses",
            mgr.num_corrupt_blocks,
        ),
    ):
        c = CounterMetricFamily(f"pdserve:{name}", doc, labels=labels)
        c.add_metric(values, value)
        yield c
    tl = [*labels, "tier"]
    hits = CounterMetricFamily(
        "pdserve:kv_offload_hit_tokens", "Prompt tokens loaded from the offload tier, per tier", labels=tl
    )
    used = GaugeMetricFamily(
        "pdserve:kv_offload_used_bytes", "Bytes the offload tier holds, per tier", labels=tl
    )
    for tier in ("cpu", "disk"):
        hits.add_metric([*values, tier], mgr.hit_tokens[tier])
    used.add_metric([*values, "cpu"], mgr.host.used_bytes if mgr.host_serves_hits else 0)
    used.add_metric([*values, "disk"], mgr.disk.used_bytes if mgr.disk is not None else 0)
    yield hits
    yield used
    hist = HistogramMetricFamily(
        "pdserve:kv_offload_load_seconds",
        "Seconds to bring a step's offloaded blocks back (disk reads and checks, host-to-device copies "
        "as the host sees them)",
        labels=labels,
    )
    cum, buckets = 0, []
    for bound, n in zip((*LOAD_SECONDS_BUCKETS, float("inf")), mgr.load_seconds_counts, strict=True):
        cum += n
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), cum))
    hist.add_metric(values, buckets, mgr.load_seconds_sum)
    yield hist
