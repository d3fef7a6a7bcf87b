"""A node's Prometheus collector: engine, KV, transfer, stage and extension counters read at scrape
time (plain int reads; no lock). ``NodeBase`` registers one on its registry."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.engine.model_runner import ModelRunner
from pdserve.kvoffload.metrics import kv_offload_metrics
from pdserve.spec_decode.metrics import spec_decode_metrics
from services.lora_rpc import lora_metric_families
from services.memwatch import resident_bytes

if TYPE_CHECKING:
    from pdserve.engine.kv_group_tables import GroupTables
    from services.node import NodeBase


class NodeCollector:
    """Reads engine counters at scrape time (plain int reads; no lock needed for metrics)."""

    def __init__(self, node: NodeBase) -> None:
        self.node = node

    def collect(self):  # type: ignore[no-untyped-def]
        n = self.node
        eng = n.engine
        pool = eng.kv.pool
        st = eng.scheduler.stats()
        labels = ["node", "role"]
        lv = [n.opts.name, n.opts.role]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"pdserve:{name}", doc, labels=labels)
            g.add_metric(lv, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"pdserve:{name}", doc, labels=labels)
            c.add_metric(lv, value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch", st.num_running)
        yield gauge("num_requests_waiting", "Requests waiting (incl. for remote KV)", st.num_waiting)
        groups = eng.kv.groups  # a hybrid model's groups after the first, with pools of their own
        usage = pool.usage
        if groups is not None:  # the fullest pool is the one that stops admission
            group_usage = zip(groups.num_used_blocks, groups.num_total_blocks, strict=True)
            usage = max(usage, *(u / t for u, t in group_usage))
        yield gauge(
            "kv_cache_usage_perc",
            "Fraction of KV blocks in use (a hybrid model: its fullest group's, kv_group_* per group)",
            usage,
        )
        yield gauge("kv_blocks_used", "KV blocks in use", pool.num_used_blocks)
        yield gauge("kv_blocks_total", "KV blocks the cache holds", eng.cache_sizes.num_blocks)
        yield gauge(
            "kv_cache_budget_bytes", "Bytes the KV cache was sized from", eng.cache_sizes.budget_bytes
        )
        yield gauge("max_model_len", "Longest request (prompt + output tokens) served", eng.max_model_len)
        yield gauge("kv_blocks_free", "KV blocks free", pool.num_free_blocks)
        kv = getattr(eng.runner, "kv_cache", None)
        if isinstance(eng.runner, ModelRunner) and kv is not None and kv.device.type == "cpu":
            # pages of the CPU KV cache in RAM: touched on first use, so up to the cache's size
            yield gauge(
                "kv_cache_resident_bytes",
                "Bytes of the CPU KV cache resident in RAM (grow on first use of a block)",
                resident_bytes(kv.data_ptr(), kv.numel() * kv.element_size()),
            )
        yield gauge("kv_blocks_cached", "KV blocks holding a prefix-cache entry", pool.num_cached_blocks)
        if groups is not None:
            yield from _group_families(labels, lv, pool.num_used_blocks, pool.num_blocks, groups)
        yield gauge("kv_blocks_held_for_transfer", "Prefill blocks held for a pull", n.held_transfer_blocks())
        yield gauge("stranded_kv_blocks", "Blocks held that no live peer will read", n.stranded_kv_blocks())
        yield gauge("ec_reservations", "Embedding-buffer reservations alive", n.ec_reservations())
        yield gauge("prefix_cache_hit_rate", "Prefix-cache block hit rate", pool.hit_rate)
        yield counter(
            "prefix_cache_queried_blocks",
            "Prompt blocks looked up in the prefix cache",
            pool.num_queried_blocks,
        )
        yield counter(
            "prefix_cache_hit_blocks", "Prompt blocks found in the prefix cache", pool.num_hit_blocks
        )
        yield counter("num_preemptions", "Preemptions by recompute", st.num_preemptions_total)
        # Batch shape: rate(engine_step_sequences) / rate(engine_steps) is the mean batch,
        # engine_step_decode_sequences the same for decodes, engine_step_tokens tokens per step.
        c = eng.counters  # StepCounters
        yield counter("engine_steps", "Engine steps launched with something scheduled", c.num_steps_total)
        yield counter(
            "engine_step_sequences", "Sequences scheduled, summed over engine steps", c.num_step_seqs_total
        )
        yield counter(
            "engine_step_tokens", "Tokens scheduled, summed over engine steps", c.num_step_tokens_total
        )
        yield counter(
            "engine_step_decode_sequences",
            "Sequences computing a single token (decodes), summed over engine steps",
            c.num_step_decode_seqs_total,
        )
        yield counter(
            "requests_aborted",
            "Requests aborted on this node",
            eng.num_aborted_total + n.aborted_holds_total(),
        )
        for name, doc, value in n.transfer_counters():
            yield counter(name, doc, value)
        yield from lora_metric_families(eng, labels, lv)
        yield from spec_decode_metrics(eng.spec, labels, lv)
        yield counter(
            "engine_prefill_tokens",
            "Prompt positions computed by the model (cache and offload hits, pulled KV excluded)",
            c.num_prefill_tokens_total,
        )
        declined = CounterMetricFamily(
            "pdserve:prefix_cache_declined_tokens",
            "Prompt tokens a prefix-cache or offload-tier lookup offered but the request did not use, by reason",
            labels=[*labels, "reason"],
        )
        for reason, tokens in eng.declined_prefix_tokens().items():
            declined.add_metric([*lv, reason], tokens)
        yield declined
        if eng.offload is not None:
            yield from kv_offload_metrics(eng.offload.manager, labels, lv)
        entries = GaugeMetricFamily(
            "pdserve:request_state_entries",
            "Entries in a per-request map of the node (0 when idle)",
            labels=[*labels, "map"],
        )
        for map_name, size in n.request_state_sizes().items():
            entries.add_metric([*lv, map_name], size)
        yield entries
        if n.frontend is not None:
            yield counter(
                "frontend_steps_sessions",
                "Steps streams served on the node's Steps socket",
                n.frontend.sessions_total,
            )
            yield counter(
                "steps_socket_refused",
                "Connections to the Steps socket closed before a stream: no hello in time, a wrong "
                "shared token, too many waiting for their hello",
                n.frontend.refused_total,
            )
        # Per pipeline stage and TP rank. One block table per node: used / held / stranded are
        # the node's numbers on every stage; bytes and failures are each endpoint's own.
        slabels = [*labels, "stage", "tp_rank"]
        used, held, stranded = pool.num_used_blocks, n.held_transfer_blocks(), n.stranded_kv_blocks()
        families = {
            "stage_kv_blocks_used": (GaugeMetricFamily, "KV blocks in use, per pipeline stage"),
            "stage_kv_blocks_held_for_transfer": (GaugeMetricFamily, "Blocks held for a pull, per stage"),
            "stage_stranded_kv_blocks": (GaugeMetricFamily, "Stranded KV blocks, per stage"),
            "stage_kv_transfer_bytes": (CounterMetricFamily, "KV bytes moved by this stage's endpoint"),
            "stage_kv_transfer_failures": (CounterMetricFamily, "KV transfers of this stage that failed"),
        }
        fams = {k: cls(f"pdserve:{k}", doc, labels=slabels) for k, (cls, doc) in families.items()}
        for i, st in enumerate(n.stages):
            sv = [*lv, str(st.pp_rank), str(st.tp_rank)]
            nbytes, failures, _ = n.stage_transfer_counters(i)
            fams["stage_kv_blocks_used"].add_metric(sv, used)
            fams["stage_kv_blocks_held_for_transfer"].add_metric(sv, held)
            fams["stage_stranded_kv_blocks"].add_metric(sv, stranded)
            fams["stage_kv_transfer_bytes"].add_metric(sv, nbytes)
            fams["stage_kv_transfer_failures"].add_metric(sv, failures)
        yield from fams.values()

    def describe(self):  # type: ignore[no-untyped-def]
        return []


def _group_families(
    labels: list[str], lv: list[str], used0: int, total0: int, groups: GroupTables
) -> Iterator[GaugeMetricFamily]:
    """A hybrid model's KV groups, each with a pool of its own (engine/kv_group_tables.py): the
    blocks in use and the pool's size per group; group 0 is the full-attention layers' pool (what
    kv_blocks_used and kv_blocks_total count)."""
    glabels = [*labels, "group"]
    used = GaugeMetricFamily(
        "pdserve:kv_group_blocks_used", "KV blocks in use, per KV cache group", labels=glabels
    )
    total = GaugeMetricFamily(
        "pdserve:kv_group_blocks_total", "KV blocks a KV cache group's pool holds", labels=glabels
    )
    used.add_metric([*lv, "0"], used0)
    total.add_metric([*lv, "0"], total0)
    for i, (u, t) in enumerate(zip(groups.num_used_blocks, groups.num_total_blocks, strict=True), start=1):
        used.add_metric([*lv, str(i)], u)
        total.add_metric([*lv, str(i)], t)
    yield used
    yield total
