"""Router metrics in the ``pdserve:`` namespace, named like the ones operators already chart.

Each :class:`RouterMetrics` owns (or is given) its ``CollectorRegistry``, so several apps can live
in one process (tests) without name clashes in the global registry. Everything is counted per
backend sequence: a request with ``n`` choices is ``n`` sequences on the nodes.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Buckets as vLLM's, so dashboards built for it read ours unchanged.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)


class RouterMetrics:
    def add_process_collector(self, collector: Any) -> None:
        """A collector of this process's state, in /metrics with or without router workers."""
        self.registry.register(collector)
        self.process_collectors.append(collector)

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        # Collectors that read this process's state at scrape time (the prefix index's): with
        # router workers they join the workers' summed files in /metrics as the answering
        # worker's view (each worker follows the same KV event streams into its own index).
        self.process_collectors: list[Any] = []
        r = self.registry
        self.time_to_first_token = Histogram(
            "pdserve:time_to_first_token_seconds",
            "Arrival at the router to the first generated token, per sequence.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "pdserve:inter_token_latency_seconds",
            "Time between consecutive deltas of a sequence, divided by the tokens in the later one.",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e_request_latency = Histogram(
            "pdserve:e2e_request_latency_seconds",
            "Arrival at the router to the last delta, per sequence.",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.request_success = Counter(
            "pdserve:request_success",
            "Sequences that finished, by finish reason (abort: client gone or node aborted).",
            ["finished_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pdserve:prompt_tokens", "Prompt tokens sent to the nodes (once per sequence).", registry=r
        )
        self.generation_tokens = Counter("pdserve:generation_tokens", "Generated tokens.", registry=r)
        self.num_requests_running = Gauge(
            "pdserve:num_requests_running",
            "Sequences in flight on the nodes.",
            registry=r,
            multiprocess_mode="livesum",  # router workers: their sum
        )
        self.http_errors = Counter(
            "pdserve:http_request_errors",
            "Requests answered with an error, by HTTP status.",
            ["status"],
            registry=r,
        )
        self.images = Counter(
            "pdserve:router_images",
            "Image parts routed, by where their embeddings come from: encoder (an encoder node), "
            "prefill (encoded by the prefill node itself), client (precomputed image_embeds).",
            ["source"],
            registry=r,
        )


def observe_n(histogram: Histogram, amount: float, n: int) -> None:
    """``n`` observations of ``amount`` at the cost of one: a stream's delta of ``n`` tokens gives
    each the same inter-token latency, and prometheus_client has no weighted ``observe`` (each
    call locks and, with router workers, writes a memory-mapped file: ~1.3 us, per token). Uses
    the histogram's bucket values (``_sum``, ``_upper_bounds``, ``_buckets``, stable since
    prometheus_client 0.4); a histogram without them is observed ``n`` times."""
    if n <= 0:
        return
    try:
        bounds, buckets, total = histogram._upper_bounds, histogram._buckets, histogram._sum
    except AttributeError:  # pragma: no cover - another prometheus_client layout
        for _ in range(n):
            histogram.observe(amount)
        return
    total.inc(amount * n)
    for i, bound in enumerate(bounds):
        if amount <= bound:
            buckets[i].inc(n)
            break
